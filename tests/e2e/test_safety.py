"""Nothing lost, nothing silent: the run dir, stopping on SIGTERM, export, health guards, restart budgets.

Through the CLI where a user meets it (a real `raygrpo train` process: its own embedded Ray
cluster, vLLM, DeepSpeed). The guards' halts and the restart budget's failure are the driver's decisions,
tested at its seam (tests/unit/test_driver_seam_halts.py: a reward that goes flat, the only engine dead past
rollout.max_restarts); what real Ray adds to the budget is here.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import ray  # noqa: TID253 - the test's stand-in actor is declared at its top
import yaml
from console import RAYGRPO, run, wait_while_running
from test_train import run_cli

from cluster.launch.waits import actor_state
from learner import checkpoint

pytestmark = pytest.mark.timeout(900)
NEVER_REACHED = 100_000  # trainer.steps of a run that a signal stops


def raw_train_steps(run_dir, so_far=False):
    """The steps of metrics.jsonl as written (not the de-duplicating reader). `so_far`: of a run still
    writing it, whose last line may be half written (left out; no file yet: none)."""
    path = run_dir / "metrics.jsonl"
    if so_far and not path.exists():
        return []
    lines = path.read_text().splitlines(keepends=True)
    whole = [line for line in lines if line.endswith("\n")] if so_far else lines
    return [row["step"] for row in map(json.loads, whole) if row["kind"] == "train"]


def wait_until(done, what, proc, timeout=600):
    """Until done() while `proc` lives."""
    wait_while_running(done, proc, timeout, lambda: f"{what}: never happened", poll_s=0.2)


def wait_for_steps(run_dir, what, ok, proc, timeout=600):
    """Until ok(the steps logged so far) while `proc` lives."""
    wait_until(lambda: ok(raw_train_steps(run_dir, so_far=True)), what, proc, timeout)


# two stories' work: 105 s alone (session 29; ~350 s before); 816 s seen on a 2-core machine at load 20-45, >1200 s: CI, stop 67
@pytest.mark.timeout(1800)
def test_sigterm_then_rerun_each_step_once_and_the_run_dir_guards(tiny_model_dir, tmp_path):
    """An async run started as a user starts it (the console script, from the user's directory, paths relative
    to it). Rollout worker 0 SIGKILLed after step 1: Ray restarts it and the run goes on (a row logs
    rollout_restarts). A second run on the same dir meanwhile is refused. SIGTERM mid-run: the step finishes,
    a checkpoint is saved, exit 143. The run dir is then copied (a copied run dir is the same run: issue 30 case
    10) and the copy loses its first metrics row and has its second cut short (every later row lost: case 3);
    the rerun of the copy resumes from the SIGTERM checkpoint, restores every row the copy lost as it was
    written, and its raw metrics.jsonl holds each step exactly once; it prints the held-out summary, its 'before'
    the first run's step-0 evaluation (data.num_eval=2, greedy: a few short generations). Then, on the stopped
    run dir: a changed config, export into a non-empty dir, and checkpoints that all fail verification are each
    refused with a message, losing nothing.
    One run and its rerun serve three stories: the run-dir guards, issue 36's untried case (a rollout worker
    killed in async, then SIGTERM and resume; formerly in test_reliability_round3_runs.py), and the resume of a
    copied run dir with a torn and a lost row (formerly test_rerun_export_resume.py's own resume of the session's
    finished run: one engine start fewer, issue 58). The runs go through the console script, the refusals
    (drivers only) through `python -m cluster.cli`: both ways in."""
    home = tmp_path / "user"
    home.mkdir()
    shutil.copytree(tiny_model_dir, home / "model")
    run_dir = home / "runs" / "async"
    # Far more steps than it will live for: SIGTERM ends it. (A run short enough to finish could end before
    # the second `train` below looks at the lock, on a quiet machine, and then nothing would be tested.)
    # No periodic checkpoint (checkpoint.every 0, the default): the one at the stopped step is SIGTERM's.
    (home / "run.yaml").write_text(yaml.safe_dump({
        "model": {"path": "model"}, "data": {"num_eval": 2, "task_digits": 1}, "algo": {"beta": 0.0},
        # halt_after 0: a tiny model's health guards must not end it before the SIGTERM (under load the zero-variance
        # guard halted it at step 66, exit 3, while the refused second `train` started: 2026-11-29)
        "trainer": {"mode": "async", "steps": NEVER_REACHED, "prompts_per_step": 4, "group_size": 4,
                    "run_dir": "runs/async", "actor_timeout_s": 600, "halt_after": 0},
        "rollout": {"max_model_len": 48, "max_new_tokens": 6, "gpu_memory_utilization": 0.03},
        "learner": {"lr": 1.0e-3, "micro_batch_size": 8}, "reward": {"functions": ["exact_match", "format"]},
        "metrics": {"tensorboard": False}}))
    log = open(tmp_path / "first.log", "w")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    proc = subprocess.Popen([RAYGRPO, "train", "run.yaml"], cwd=home, stdout=log, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)
    try:
        # The same run dir while the first run lives: asked while its actors start, not once it steps (issue 58: a
        # tiny model's async steps take ~0.1 s, and the run had gone 350 steps further while this was refused).
        wait_until(lambda: (run_dir / "raygrpo.lock.holder").exists(), "the run dir claimed", proc)
        second = run_cli("train", "run.yaml", cwd=home)
        assert second.returncode == 2 and f"in use by another run: pid {proc.pid}" in second.stderr, second.stderr
        wait_for_steps(run_dir, "step 1 logged", lambda steps: 1 in steps, proc)
        [worker] = [a for a in json.loads((run_dir / "placement.json").read_text()) if a["role"] == "rollout-0"]
        os.kill(worker["pid"], signal.SIGKILL)
        killed_after = raw_train_steps(run_dir, so_far=True)[-1]
        wait_for_steps(run_dir, "two more steps after the kill", lambda steps: steps[-1] >= killed_after + 2, proc)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    out = (tmp_path / "first.log").read_text()
    assert rc == 128 + signal.SIGTERM, out[-3000:]
    assert "stopped by SIGTERM after step" in out and "Traceback" not in out, out[-3000:]
    stopped_at = raw_train_steps(run_dir)[-1]
    assert stopped_at < NEVER_REACHED, "the run ended before SIGTERM arrived: nothing was tested"
    # the rerun finishes one more step (a new trainer.steps is not a config change): a step logged twice after the
    # resume, or one skipped, shows in the raw rows below either way
    end = stopped_at + 1
    assert checkpoint.latest_complete(run_dir / "checkpoints").endswith(checkpoint.step_dir_name(stopped_at))
    assert not (run_dir / "raygrpo.lock").exists()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("rollout_restarts", 0) >= 1 for r in rows if r["kind"] == "train"), "no restart was logged"

    copy = home / "runs" / "copied"
    shutil.copytree(run_dir, copy)
    original = (copy / "metrics.jsonl").read_text().splitlines(keepends=True)
    (copy / "metrics.jsonl").write_text(original[1][:50])  # the first row lost, the second torn, the rest lost
    rerun = run(["train", "run.yaml", f"trainer.run_dir={copy.relative_to(home)}", f"trainer.steps={end}"], home)
    rerun.report("async rerun of a copied run dir after a killed worker and SIGTERM")
    assert rerun.returncode == 0, rerun.text[-3000:]
    assert f"resumed from {copy / 'checkpoints' / checkpoint.step_dir_name(stopped_at)} at step {stopped_at}" \
        in rerun.text, rerun.text[-3000:]
    assert f"restored {len(original)} row(s)" in rerun.text, rerun.text[-3000:]
    assert "Traceback" not in rerun.text, rerun.text[-3000:]
    assert "held-out accuracy: " in rerun.text and " -> " in rerun.text, rerun.text[-3000:]  # 'before': the first run's
    raw = (copy / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert raw[:len(original)] == original  # the very rows, as written
    assert raw_train_steps(copy) == list(range(1, end + 1))
    assert (copy / "metrics.jsonl.superseded").read_text() == original[1][:50] + "\n"

    changed = run_cli("train", "run.yaml", "learner.lr=0.5", cwd=home)
    assert changed.returncode == 2 and "learner.lr: 0.001 -> 0.5" in changed.stderr, changed.stderr

    final = checkpoint.latest_complete(run_dir / "checkpoints")
    target = tmp_path / "exported"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    refused = run_cli("export", final, target, cwd=home)
    assert refused.returncode == 2 and "not empty" in refused.stderr and (target / "notes.txt").exists()
    done = run_cli("export", final, target, "--overwrite", cwd=home)
    assert done.returncode == 0, done.stderr
    assert (target / "model.safetensors").exists() and not (target / "notes.txt").exists()

    for ckpt in checkpoint.list_checkpoints(run_dir / "checkpoints"):  # every checkpoint broken
        (Path(ckpt) / checkpoint.MANIFEST).unlink()
    broken = run_cli("train", "run.yaml", f"trainer.steps={end + 10}", cwd=home)
    assert broken.returncode == 2, broken.stderr
    assert "fails verification" in broken.stderr and "no COMPLETE marker" in broken.stderr
    assert all(c in broken.stderr for c in checkpoint.list_checkpoints(run_dir / "checkpoints"))
    assert raw_train_steps(run_dir) == list(range(1, stopped_at + 1))  # nothing was trained over


@ray.remote(num_cpus=0, max_restarts=0)
class Stub:
    """An actor with rollout.max_restarts=0's restart budget, as cluster/launch/placement.py starts an engine."""

    def pid(self) -> int:
        return os.getpid()


def test_an_actor_past_its_restart_budget_is_dead_in_rays_table_at_once(ray_cluster):
    """What the driver reads when an engine with rollout.max_restarts=0 dies (cluster/launch/waits.py actor_state,
    read by RolloutPool.recover): Ray's own table says DEAD with 0 restarts, within seconds, so the driver fails
    the run at once instead of polling a dead actor for trainer.actor_timeout_s. That decision, over a fake engine
    whose state is DEAD as here: tests/unit/test_driver_seam_halts.py (the only engine dead past its budget fails
    the run naming rollout.max_restarts=0); this is what tests/fakes/ray_like.py's `die` (DEAD, 0 restarts) stands
    for. Formerly a run of its own (a Trainer with one engine and a learner group, SIGKILLed at step 0): issue 58,
    one engine start fewer."""
    stub = Stub.remote()
    pid = ray.get(stub.pid.remote())
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(stub.pid.remote(), timeout=60)
    deadline = time.monotonic() + 30
    while actor_state(stub)[0] != "DEAD" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert actor_state(stub) == ("DEAD", 0)
