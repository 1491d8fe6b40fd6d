"""`raygrpo demo --recipe NAME` through the CLI's own entry point (real Ray, vLLM, DeepSpeed), one step with a
short warm start and a small evaluation: the default demo (addition) and the reward_model recipe each print the
before/after table and verdict, write `kind: eval` rows, and verify the weight sync of the step. What is shown
here is that a recipe starts and steps (issue 58: a test that a recipe starts need not train it long); whether
each recipe *learns* is shown by the full runs in docs/STATUS.md, not here (minutes each).

Two runs, not one per recipe (issue 58: each is an engine and a learner group). What the others add is caught
without an engine start of their own: each recipe's config, data, warm start and reward model as the CLI composes
them, tests/unit/test_demo_prepare.py (and the step-4 results, the tools recipe's tool rows included); the chat
and tools warm starts, for real on their own data and checks, below; what their runs then do, by the tests of
each mode: LoRA's adapter sync (test_lora_end_to_end.py, test_smollm2.py's LoRA CLI run), async
(test_train.py's async run), a chat model on conversational data under gsm8k (test_chat_data.py), the
calculator environment through the CLI (test_multiturn.py) and its evaluation's tool rows
(tests/unit/test_multiturn_evaluation.py).
The two runs share one cache dir, as a user's do: reward_model reuses the addition warm start and trains on its
reward model's score alone (built from that warm start, a few Bradley-Terry steps here).
"""
from __future__ import annotations

import json

import pytest
import yaml

from cluster.cli import build_parser, main
from cluster.demo.demo import prepare_demo
from cluster.models.warmstart import warm_start_result
from cluster.run.metrics import read_metrics

# The smallest sizes each recipe's config accepts: one step, a warm start of a few steps, 8 held-out prompts
SMALL = ["--steps", "1", "--warm-start-steps", "10", "trainer.prompts_per_step=4", "trainer.group_size=4",
         "trainer.max_extra_prompts=4", "data.num_eval=8", "trainer.eval_pass_k=2", "metrics.tensorboard=false",
         "trainer.actor_timeout_s=300"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("demo-cache")


@pytest.fixture(scope="module")
def length_reward(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "length_reward.py"
    path.write_text("def reward(prompt, completion, **kw):\n    return len(completion) / 10\n")
    return path


@pytest.mark.parametrize("recipe", ["addition", "reward_model"])
def test_recipe_starts_and_steps_with_a_verified_sync(recipe, cache, length_reward, ray_cluster, tmp_path, capsys):
    run_dir = tmp_path / "run"
    # A few warm-start steps leave the model always wrong, and a group of equal rewards trains nothing: a reward
    # on the completion's length beside exact_match gives the step an update to verify. A reward model's scores
    # differ between samples: every group has a signal without a second reward.
    rewards = (["--reward-model-steps", "10"] if recipe == "reward_model"
               else [f"reward.functions=[exact_match, '{length_reward}:reward']"])
    assert main(["demo", "--recipe", recipe, "--run-dir", str(run_dir), "--cache-dir", str(cache), "--seed", "1",
                 *SMALL, *rewards]) == 0
    out = capsys.readouterr().out
    assert "[4/4] held-out evaluation (8 unseen prompts)" in out and "verdict: held-out greedy accuracy" in out
    assert "tool_calls_per_trajectory (greedy)" not in out  # the tools recipe's alone
    evals = read_metrics(run_dir, kind="eval")
    assert [r["step"] for r in evals] == [0, 1] and all(r["num_prompts"] == 8 for r in evals)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1]
    # the step trained, sent an update, and found it on every engine
    assert [r["sync_verified"] for r in rows] == [True], rows
    assert "weight sync verified at 1 of 1 steps" in out
    config = (run_dir / "config.yaml").read_text()
    assert "seed: 1" in config and "mode: sync" in config and "tool_call_rate" not in evals[-1]
    if recipe == "reward_model":  # built after the warm start, from it; the run scored by it alone
        rm = cache / "rm-warm-to0.25-seed1-threads1"
        assert "reward model from the warm start (10 Bradley-Terry steps on its own samples" in out
        assert yaml.safe_load(config)["reward"]["functions"] == [f"model:{rm}"]
        assert all("rewards/addition_rm/mean" in r for r in rows), rows[0].keys()


@pytest.mark.parametrize("recipe", ["chat", "tools"])
def test_the_chat_and_tools_recipes_warm_start_on_their_own_data(recipe, cache, tmp_path, capsys):
    """No engine: `raygrpo demo --recipe chat|tools` up to GRPO (cluster/demo/demo.py prepare_demo, as the CLI
    calls it): the chat base model, the recipe's data written, its warm start trained on them rendered with the
    chat template (tools: on the assistant turns of conversations with the calculator) and checked by the recipe's
    own check (chat: gsm8k greedy; tools: the calculator in the loop, the first call forced), then the run's config
    on that warm start. What the run then does: the module's docstring."""
    args = build_parser().parse_args(["demo", "--recipe", recipe, "--run-dir", str(tmp_path / "run"), "--cache-dir",
                                      str(cache), "--seed", "1", *SMALL])
    run = prepare_demo(args)
    out = capsys.readouterr().out
    check = {"chat": "greedy accuracy", "tools": "greedy accuracy with a forced first call"}[recipe]
    warm = cache / f"warm-{recipe}-to{run.recipe.warm_start.target_accuracy:.2f}-seed1-threads1"
    assert run.cfg.model.path == str(warm) and run.cfg.data.train == str(cache / f"data-{recipe}" / "train.jsonl")
    # 10 steps never reach its target (checked at 2 checks in a row): it ran to the cap, and its check scored it
    done = warm_start_result(warm)
    assert done["steps"] == 10 and 0.0 <= done["accuracy"] <= 1.0, done
    assert f"stopped at step 10 with {check} {done['accuracy']:.3f} on its own 200 check prompts" in out
    assert ("forced-call check: accuracy" in out) == (recipe == "tools")
    if recipe == "chat":
        first = json.loads((cache / "data-chat" / "train.jsonl").read_text().splitlines()[0])
        assert first["prompt"][0]["role"] == "system" and "####" in first["answer"]
