"""Hostile and hanging reward code in real runs, through the CLI, as the adversary found them (issue 30):
a function that kills its parent, one that kills its parent now and then, one that hangs on every call.

The one that kills its parent now and then is tested in tests/e2e/test_reward_verifier.py, in the
verifier's run (one CLI run, with its Ray cluster, engine and learner, serves both): the verifier runs
in the driver, the function in the worker processes it kills."""
from __future__ import annotations

import re
import textwrap
import time
from pathlib import Path

from cluster.run.metrics import read_metrics
from tests.e2e.test_train import run_cli


def write_run(tmp_path: Path, tiny_model_dir, reward_code: str, *extra: str, prompts: int = 4) -> Path:
    """A user's reward file and config, outside the checkout."""
    (tmp_path / "my_reward.py").write_text(textwrap.dedent(reward_code))
    cfg = tmp_path / "run.yaml"
    cfg.write_text(textwrap.dedent(f"""
        model: {{path: {tiny_model_dir}}}
        data: {{train: "task:addition", task_digits: 1, num_eval: 0}}
        trainer: {{run_dir: {tmp_path / 'run'}, steps: 2, prompts_per_step: {prompts}, group_size: 4, actor_timeout_s: 300}}
        rollout: {{max_model_len: 48, max_new_tokens: 4, gpu_memory_utilization: 0.03}}
        learner: {{micro_batch_size: 8}}
        metrics: {{tensorboard: false}}
    """) + "".join(f"{line}\n" for line in extra))
    return cfg


def test_a_reward_that_kills_its_parent_cannot_take_the_driver_down(tiny_model_dir, tmp_path):
    """The case as found: os.kill(os.getppid(), SIGKILL) on every call ended the run with exit 137, no
    message, a stale lock. Now each call's worker dies alone: every call is an error, so no function
    scored any sample and the run halts after step 1's metrics row with the reason (exit 3, issue 36), the
    lock released."""
    cfg = write_run(tmp_path, tiny_model_dir, """
        import os, signal, time

        def reward(prompt, completion, **kw):
            os.kill(os.getppid(), signal.SIGKILL)
            time.sleep(1)  # dies here (its keeper is gone); without it a call may still send its 1.0 first
            return 1.0
    """, "reward: {functions: [my_reward.py:reward], num_procs: 2}")
    out = run_cli("train", cfg, cwd=tmp_path)
    assert out.returncode == 3, (out.returncode, out.stderr[-2000:])
    assert "raygrpo: run halted: no reward function scored any sample at step 1 (each got reward.fallback): " \
           "the reward function reward failed every call (16 error(s)), first: reward process died" in out.stderr
    assert "reward process died (exit code -9)" in out.stderr
    [row] = read_metrics(tmp_path / "run")  # the step's row, written before the halt
    assert row["step"] == 1 and row["rewards/reward/errors"] == 16 and row["update_skipped"] is True
    assert not (tmp_path / "run" / "raygrpo.lock").exists() and (tmp_path / "run" / "config.yaml").exists()


def test_a_reward_that_hangs_on_every_call_stops_the_run_naming_it_and_its_timeout(tiny_model_dir, tmp_path):
    """The case as found: timed-out calls ran one after another per process (32 calls x 3 s / 2 processes
    = 48 s of silence here, 21 min at the defaults with 256). Now the first call of each process times
    out, the rest run at once, and the run stops after step 1 (its metrics row written) with the function's
    name and its timeout."""
    cfg = write_run(tmp_path, tiny_model_dir, """
        import time

        def slow_judge(prompt, completion, **kw):
            time.sleep(3600)
    """, "reward: {functions: [my_reward.py:slow_judge], num_procs: 2, timeout_s: 3}", prompts=8)
    t0 = time.monotonic()
    out = run_cli("train", cfg, cwd=tmp_path)
    took = time.monotonic() - t0
    assert out.returncode == 3, out.stderr[-3000:]
    assert ("raygrpo: run halted: no reward function scored any sample at step 1 (each got reward.fallback): the "
            "reward function slow_judge failed every call (32 error(s), every call timed out (reward.timeout_s=3)), "
            "first: timed out after 3s") in out.stderr
    assert [r["rewards/slow_judge/errors"] for r in read_metrics(tmp_path / "run")] == [32]
    # Each of the 2 processes takes one first call; their deadlines are the time between the two sends apart, so a
    # loaded machine may see the first expire alone ("1 of its first 1", the other still in flight: 30 left either way)
    said = re.search(r"rewards: slow_judge timed out on ([12]) of its first \1 calls: its other 30 run at once now, "
                     r"each with its own 3 s deadline", out.stderr)
    assert said, out.stderr[-3000:]
    print(f"the whole run (actors' start included) took {took:.0f} s")
    assert not (tmp_path / "run" / "raygrpo.lock").exists()
