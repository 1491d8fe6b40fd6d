"""Issue 30 cases 5 and 6 (the environment's half): environment failures said on the console when they
happen, a broken environment diagnosed as such, hanging environment calls timed out together and never
silent. One real run through the CLI (Ray, vLLM, DeepSpeed, the offline chat model) with an environment of
the user's in the user's directory: its evaluation hangs and floods, its training fails at every reset.
"""
from __future__ import annotations

import textwrap

import pytest
import yaml
from console import run

from cluster.models.wordproblems import write_jsonl
from cluster.run.metrics import read_metrics

pytestmark = pytest.mark.timeout(900)

# Each row says what its environment does: fail at reset (every training row), or, at its first step, hang (cut
# at rollout.env_timeout_s) or answer with a 100,000-character tool message (more than rollout.max_model_len holds).
ENV = textwrap.dedent('''
    import time

    class Tool:
        def __init__(self, mode="flood", **fields):
            self.mode = mode

        def reset(self):
            if self.mode == "broken":
                raise RuntimeError("no sandbox available")
            return None

        def step(self, text):
            if self.mode == "hang":
                time.sleep(3600)
            return {"messages": [{"role": "tool", "content": "x" * 100_000}], "done": False}
''')


def rows(modes: list[str]) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"Tom has {a} apples and gets 2 more. How many?"}],
             "answer": f"#### {a + 2}", "mode": mode} for a, mode in enumerate(modes)]


@pytest.fixture
def home(tmp_path, tiny_chat_model_dir):
    (tmp_path / "model").symlink_to(tiny_chat_model_dir)
    return tmp_path


def test_a_broken_environment_halts_the_run_naming_it_and_hanging_calls_time_out_together_never_quiet(home):
    """Case 5: a reset that raised failed every trajectory; env_errors counted it in the metrics only, the run
    exited 0, and the health guard said "policy collapsed". Case 6: an env step that hangs (env_timeout_s=3) gave
    no output for over 230 s, not even the step-0 evaluation: its timed-out calls ran one after another; and a
    100k-character tool message ended its trajectory quietly.

    One run shows both (issue 58: it was two, one engine start each): its held-out rows hang or flood in the
    step-0 evaluation (greedy and pass@2: env_timeout_s=1 is waited out in each of its batches, together, while a
    flood answers in milliseconds), then every training row's reset raises, and after trainer.halt_after=2 such
    steps the run halts naming the environment."""
    (home / "my_env.py").write_text(ENV)
    write_jsonl(home / "train.jsonl", rows(["broken"] * 8))
    write_jsonl(home / "eval.jsonl", rows(["hang", "flood", "hang", "flood"]))
    (home / "run.yaml").write_text(yaml.safe_dump({
        "model": {"path": "model"}, "data": {"train": "train.jsonl", "eval": "eval.jsonl", "num_eval": 4},
        "trainer": {"steps": 3, "prompts_per_step": 2, "group_size": 2, "run_dir": "runs/env", "actor_timeout_s": 300,
                    "halt_after": 2, "eval_pass_k": 2},
        "rollout": {"env": "my_env.py:Tool", "max_turns": 2, "max_new_tokens": 8, "max_model_len": 192,
                    "cpu_kv_cache_mb": 64, "env_timeout_s": 1.0},
        "reward": {"functions": ["exact_match"]}, "learner": {"lr": 1.0e-4, "micro_batch_size": 4},
        "metrics": {"tensorboard": False}}))
    out = run(["train", "run.yaml"], home)
    report = out.report("a broken environment after hanging and flooding evaluation calls")
    assert out.returncode == 3, out.text[-3000:]

    # the evaluation's hangs and floods: said when they happen, the hangs cut at the timeout, never quiet
    assert "eval @ step 0" in out.text
    assert "trajectories failed at the evaluation at step 0" in out.text and "step: step timed out after 1s" in out.text
    assert out.text.count("did not fit in rollout.max_model_len=192") == 1, out.text[-3000:]  # said once
    assert out.longest_silence()[0] < 30.0, report

    # training: every reset raised, said at each step, and the halt names the environment, not the policy
    assert ("environment: 4 of 4 trajectories failed at step 1 (each ended there; counted as env_errors), first: "
            "reset: RuntimeError: no sandbox available") in out.text, out.text[-3000:]
    halt = [line for _, line in out.lines if line.startswith("raygrpo: run halted")]
    assert halt and "the environment failed every trajectory (4 env_errors)" in halt[0], out.text[-3000:]
    assert "rollout.env" in halt[0] and "collapsed" not in halt[0] and "learning signal" not in halt[0]
    rows_logged = read_metrics(home / "runs" / "env")
    assert [r["env_errors"] for r in rows_logged] == [4, 4]
