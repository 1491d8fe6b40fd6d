"""Issue 30 cases 5 and 6 (the environment's half): environment failures said on the console when they
happen, a broken environment diagnosed as such, hanging environment calls timed out together and never
silent. Two real runs through the CLI (Ray, vLLM, DeepSpeed, the offline chat model), each with an
environment of the user's in the user's directory.
"""
from __future__ import annotations

import json
import textwrap

import pytest
import yaml
from console import run

from cluster.run.metrics import read_metrics

pytestmark = pytest.mark.timeout(900)

BROKEN_ENV = textwrap.dedent('''
    class Sandbox:
        def __init__(self, **fields):
            pass

        def reset(self):
            raise RuntimeError("no sandbox available")

        def step(self, text):
            return {"messages": [], "done": True}
''')

# Each row says what its environment does at its first step: hang (cut at rollout.env_timeout_s), or
# answer with a 100,000-character tool message (more than rollout.max_model_len holds).
SLOW_ENV = textwrap.dedent('''
    import time

    class Tool:
        def __init__(self, mode="flood", **fields):
            self.mode = mode

        def reset(self):
            return None

        def step(self, text):
            if self.mode == "hang":
                time.sleep(3600)
            return {"messages": [{"role": "tool", "content": "x" * 100_000}], "done": False}
''')


def user_dir(tmp_path, env_code: str, env_class: str, **overrides) -> str:
    (tmp_path / "my_env.py").write_text(env_code)
    rows = [{"prompt": [{"role": "user", "content": f"Tom has {a} apples and gets 2 more. How many?"}],
             "answer": f"#### {a + 2}", "mode": ("hang", "flood")[a % 2]} for a in range(8)]
    (tmp_path / "problems.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"model": {"path": "model"}, "data": {"train": "problems.jsonl", "num_eval": 0},
           "trainer": {"steps": 3, "prompts_per_step": 2, "group_size": 2, "run_dir": "runs/env", "actor_timeout_s": 300},
           "rollout": {"env": f"my_env.py:{env_class}", "max_turns": 2, "max_new_tokens": 8, "max_model_len": 192,
                       "cpu_kv_cache_mb": 64},
           "reward": {"functions": ["exact_match"]}, "learner": {"lr": 1.0e-4, "micro_batch_size": 4},
           "metrics": {"tensorboard": False}}
    for key, value in overrides.items():
        section, name = key.split("__")
        cfg[section][name] = value
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    return "run.yaml"


@pytest.fixture
def home(tmp_path, tiny_chat_model_dir):
    (tmp_path / "model").symlink_to(tiny_chat_model_dir)
    return tmp_path


def test_an_environment_that_fails_every_trajectory_is_said_and_halts_the_run_naming_it(home):
    """Case 5: a reset that raises failed every trajectory; env_errors counted it in the metrics only, the
    run exited 0, and the health guard said "policy collapsed"."""
    out = run(["train", user_dir(home, BROKEN_ENV, "Sandbox", trainer__halt_after=2)], home)
    out.report("an environment failing every trajectory")
    assert out.returncode == 3, out.text[-3000:]
    assert ("environment: 4 of 4 trajectories failed at step 1 (each ended there; counted as env_errors), first: "
            "reset: RuntimeError: no sandbox available") in out.text, out.text[-3000:]
    halt = [line for _, line in out.lines if line.startswith("raygrpo: run halted")]
    assert halt and "the environment failed every trajectory (4 env_errors)" in halt[0], out.text[-3000:]
    assert "rollout.env" in halt[0] and "collapsed" not in halt[0] and "learning signal" not in halt[0]
    rows = read_metrics(home / "runs" / "env")
    assert [r["env_errors"] for r in rows] == [4, 4]


def test_hanging_environment_calls_time_out_together_and_the_console_never_goes_quiet(home):
    """Case 6: an env step that hangs (env_timeout_s=3) gave no output for over 230 s, not even the step-0
    evaluation: its timed-out calls ran one after another. Case 5: a 100k-character tool message ended its
    trajectory quietly. Here half the rows hang and half flood, in the step-0 evaluation and in training.
    env_timeout_s=1: the run waits out the hang in each of its batches (the evaluations' greedy and sampled
    ones, training's), so the timeout is most of its time after the start; a flood answers in milliseconds."""
    cfg = user_dir(home, SLOW_ENV, "Tool", rollout__env_timeout_s=1.0, trainer__steps=1,
                   data__eval="problems.jsonl", data__num_eval=4, trainer__eval_pass_k=2)
    out = run(["train", cfg], home)
    report = out.report("hanging environment calls")
    assert out.returncode == 0, out.text[-3000:]
    assert "eval @ step 0" in out.text
    assert "trajectories failed at the evaluation at step 0" in out.text and "step: step timed out after 1s" in out.text
    assert out.text.count("did not fit in rollout.max_model_len=192") == 1, out.text[-3000:]  # said once
    [row] = read_metrics(home / "runs" / "env")
    assert row["env_errors"] + row["env_overflows"] == 4, row  # every trajectory ended by its hang or its flood
    assert out.longest_silence()[0] < 30.0, report
