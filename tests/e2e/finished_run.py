"""One finished run of the tiny model for the session, started as a user starts it: the console script, from
the user's directory, with a config there whose paths are relative to it (they cross into the actors, so they
must be made absolute first). Its model declares no EOS (issue 30 case 7), so the run also shows that warning.

Read by the tests of a finished run (test_reliability_runs.py, test_reliability_round3_runs.py); a test that
changes a run, or reruns one (a rerun rewrites config.yaml and takes the run dir's lock), works on a copy of it
(copy_run), so the tests share it without touching one another. `make test` runs those two files in two pytest
workers at once (`--dist loadfile`), and a session fixture is made once per worker: the run is made once for
the session by the first worker that needs it and read by the other (once_for_the_session), as pytest-xdist's
documentation says to share a session fixture's work between workers.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from console import Console, run
from filelock import FileLock

STEPS = 2


def drop_eos(model: Path) -> None:
    """No end-of-sequence token anywhere: the tokenizer, generation_config.json, config.json."""
    for name, key in (("tokenizer_config.json", "eos_token"), ("config.json", "eos_token_id")):
        data = json.loads((model / name).read_text())
        data.pop(key, None)
        (model / name).write_text(json.dumps(data))
    (model / "generation_config.json").unlink()


def finish_a_run(home: Path, tiny_model_dir: Path) -> tuple[Path, Path, Console]:
    """(the user's directory, the run dir, the run's console) of a STEPS-step run with a checkpoint at every step."""
    shutil.copytree(tiny_model_dir, home / "model")
    drop_eos(home / "model")
    (home / "run.yaml").write_text(yaml.safe_dump({
        "model": {"path": "model"}, "data": {"num_eval": 0, "task_digits": 1},
        "trainer": {"steps": STEPS, "prompts_per_step": 4, "group_size": 4, "run_dir": "runs/first",
                    "actor_timeout_s": 300},
        "rollout": {"max_model_len": 48, "max_new_tokens": 6, "gpu_memory_utilization": 0.03},
        "learner": {"lr": 1.0e-3, "micro_batch_size": 8}, "reward": {"functions": ["exact_match", "format"]},
        "checkpoint": {"every": 1}}))  # TensorBoard on: the default
    out = run(["train", "run.yaml"], home)
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
