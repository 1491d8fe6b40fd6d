"""Hanging reward code in a real run, through the CLI, as the adversary found it (issue 30): a function that
hangs on every call.

The other hostile functions of issue 30 are shown in runs that start anyway (each CLI run starts its own Ray
cluster, engine and learner):
  - one that kills its parent now and then: tests/e2e/test_reward_verifier.py, in the verifier's run (the
    verifier runs in the driver, the function in the worker processes it kills): the driver survives, and
    "reward process died (exit code -9)" is said;
  - one that kills its parent on every call: the same kill, on every call, is a failed call like any other
    (tests/unit/test_reward_isolation.py); a step that no function scored halts the run at once after its
    metrics row (tests/unit/test_reward_fails_alone.py, the driver's loop over fakes), and a halted run exits 3
    with its lock released (tests/e2e/test_reward_fails_alone_end_to_end.py).
"""
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
