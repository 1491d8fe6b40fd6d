"""One finished run of the tiny model for the session, started as a user starts it: the console script, from
the user's directory, with a config there whose paths are relative to it (they cross into the actors, so they
must be made absolute first). Every test that only reads a finished run reads this one, so one stack start
serves them all (issue 58). What the run carries, so that each reader finds its claim in it:
  - its model declares no EOS (issue 30 case 7): the run also shows that warning;
  - STEPS steps with a checkpoint at every step, an evaluation before, every EVAL_EVERY steps and after (greedy
    + pass@2), a built-in and a user's reward function (my_rewards.py:brevity), TensorBoard, and W&B on with no
    API key, as on a machine that never ran `wandb login` (new_users_env): it logs offline by itself;
  - a KL term (algo.beta > 0) with the reference on the learner rank (the sync schedule on CPU), and its
    checkpoints from step OLDEST_KEPT on: test_train.py's exact-resume test resumes that one with the reference
    on its own actor and compares the later steps with this run's, so that test starts no full run of its own.

Read by test_rerun_export_resume.py, test_interrupted_export_and_full_disk.py, test_progress_and_throughput.py and
test_train.py's exact-resume test;
a test that changes a run, or reruns one (a rerun rewrites config.yaml and takes the run dir's lock), works on a
copy of it (copy_run), so the tests share it without touching one another. `make test` runs those files in two
pytest workers at once (`--dist loadfile`), and a session fixture is made once per worker: the run is made once
for the session by the first worker that needs it and read by the others (once_for_the_session), as
pytest-xdist's documentation says to share a session fixture's work between workers.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from console import Console, run
from filelock import FileLock

STEPS = 4
EVAL_EVERY = 2
OLDEST_KEPT = 2  # the oldest checkpoint the run keeps (checkpoint.keep), the one test_train.py resumes
WANDB = {"wandb": True, "wandb_project": "raygrpo-e2e", "wandb_run_name": "offline-try-1", "wandb_tags": ["e2e"]}

# The user's reward function, beside the built-in exact_match: one short name per function everywhere.
BREVITY = """
def brevity(completions, **kwargs):
    return [1.0 / (1 + len(c)) for c in completions]
"""


def new_users_env(home: Path) -> dict:
    """This process's environment as a new W&B user's: no WANDB_* variable (no key, no mode) and a HOME without
    a ~/.netrc from an earlier `wandb login`, but with the caches a machine that ran raygrpo before has (a
    user's ~/.cache): without them the learner compiles DeepSpeed's op again (about a minute of CPU)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    fake_home = home / "home"
    if not fake_home.exists():
        fake_home.mkdir()
        (fake_home / ".cache").symlink_to(Path.home() / ".cache", target_is_directory=True)
    env["HOME"] = str(fake_home)
    return env


def drop_eos(model: Path) -> None:
    """No end-of-sequence token anywhere: the tokenizer, generation_config.json, config.json."""
    for name, key in (("tokenizer_config.json", "eos_token"), ("config.json", "eos_token_id")):
        data = json.loads((model / name).read_text())
        data.pop(key, None)
        (model / name).write_text(json.dumps(data))
    (model / "generation_config.json").unlink()


def finish_a_run(home: Path, tiny_model_dir: Path) -> tuple[Path, Path, Console]:
    """(the user's directory, the run dir, the run's console) of the session's STEPS-step run."""
    shutil.copytree(tiny_model_dir, home / "model")
    drop_eos(home / "model")
    (home / "my_rewards.py").write_text(BREVITY)
    (home / "run.yaml").write_text(yaml.safe_dump({
        "model": {"path": "model"}, "data": {"num_eval": 4, "task_digits": 1},
        "trainer": {"steps": STEPS, "prompts_per_step": 4, "group_size": 4, "run_dir": "runs/first",
                    "actor_timeout_s": 600, "eval_every": EVAL_EVERY, "eval_pass_k": 2,
                    "dynamic_sampling": False, "halt_after": 0},  # a tiny model's guards must not end it early
        "rollout": {"max_model_len": 48, "max_new_tokens": 6, "gpu_memory_utilization": 0.03},
        "learner": {"lr": 1.0e-3, "micro_batch_size": 8},
        "algo": {"beta": 0.05},  # reference.placement auto: on the learner rank, no reference actor
        "reward": {"functions": ["exact_match", "my_rewards.py:brevity"]},
        "metrics": {"completions_per_step": 2, "peak_tflops": 1.0, **WANDB},  # TensorBoard on: the default
        "checkpoint": {"every": 1, "keep": STEPS - OLDEST_KEPT + 1}}))
    out = run(["train", "run.yaml"], home, env=new_users_env(home))
    out.report(f"a {STEPS}-step run")
    assert out.returncode == 0, out.text[-3000:]
    return home, home / "runs" / "first", out


def copy_run(home: Path, run_dir: Path, name: str) -> Path:
    """A copy of the finished run dir beside it (home/runs/NAME), for a test that changes a run."""
    copy = home / "runs" / name
    shutil.copytree(run_dir, copy)
    return copy


def once_for_the_session(shared: Path, tiny_model_dir: Path) -> tuple[Path, Path, Console]:
    """finish_a_run made once for all the pytest-xdist workers of a session: in `shared` (the directory the
    workers' temporary directories share), under a file lock they share. The first worker here makes the run
    while holding the lock; a later one waits on the lock, then reads the run and its console from there.
    `finished.json` is written only once the run finished as expected: a run that failed (failed.txt holds
    why), or whose worker died while making it, is reported to every later worker as such, never reused
    half made."""
    base = shared / "finished-run"
    done, failed = base / "finished.json", base / "failed.txt"
    with FileLock(str(shared / "finished-run.lock")):
        if done.is_file():
            saved = json.loads(done.read_text())
            out = Console(saved["returncode"], [(t, line) for t, line in saved["lines"]], saved["seconds"])
            print(f"the session's finished run, made by another pytest worker: {saved['run_dir']}")
            return Path(saved["home"]), Path(saved["run_dir"]), out
        if failed.is_file():
            pytest.fail(f"the session's finished run failed in another pytest worker:\n{failed.read_text()}",
                        pytrace=False)
        if base.exists():
            pytest.fail(f"the session's finished run in {base} was left half made (its pytest worker stopped "
                        f"while making it)", pytrace=False)
        (base / "user").mkdir(parents=True)
        try:
            home, run_dir, out = finish_a_run(base / "user", tiny_model_dir)
        except BaseException as e:
            failed.write_text(f"{type(e).__name__}: {e}")
            raise
        done.write_text(json.dumps({"home": str(home), "run_dir": str(run_dir), "returncode": out.returncode,
                                    "lines": out.lines, "seconds": out.seconds}))
        return home, run_dir, out
