"""`raygrpo demo --recipe NAME`, one step of each recipe through the CLI's own entry point (real Ray,
vLLM, DeepSpeed), with a short warm start and a small evaluation: each prints the before/after table
and verdict, writes `kind: eval` rows, and verifies the weight sync of the step. What is shown here is
that a recipe's config starts and steps (issue 58: a test that a recipe starts need not train it long);
whether each recipe *learns* is shown by the full runs in docs/STATUS.md, not here (minutes each).
The recipes share one cache dir, as a user's do: addition, lora, async and reward_model share their
base model and warm start, chat and tools theirs. reward_model trains on its reward model's score
alone (built from the warm start, a few Bradley-Terry steps here), so it keeps its own reward.functions.
"""
from __future__ import annotations

import json

import pytest
import yaml

from cluster.cli import DEMO_RECIPES, main
from cluster.demo.recipes import RECIPES
from cluster.run.metrics import read_metrics

# The smallest sizes each recipe's config accepts: one step, a warm start of a few steps, 8 held-out prompts
SMALL = ["--steps", "1", "--warm-start-steps", "10", "trainer.prompts_per_step=4", "trainer.group_size=4",
         "trainer.max_extra_prompts=4", "data.num_eval=8", "trainer.eval_pass_k=2", "metrics.tensorboard=false",
         "trainer.actor_timeout_s=300"]


# A few warm-start steps leave the model always wrong, and a group of equal rewards trains nothing:
# a reward on the completion's length beside the recipe's own gives every step an update to verify.
CHECKER = {"addition": "exact_match", "lora": "exact_match", "async": "exact_match", "chat": "gsm8k", "tools": "gsm8k"}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("demo-cache")


@pytest.fixture(scope="module")
def length_reward(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "length_reward.py"
    path.write_text("def reward(prompt, completion, **kw):\n    return len(completion) / 10\n")
    return path


def test_the_cli_offers_every_recipe():
    assert set(DEMO_RECIPES) == set(RECIPES)


@pytest.mark.parametrize("recipe", ["addition", "lora", "async", "chat", "tools", "reward_model"])
def test_recipe_starts_and_steps_with_a_verified_sync(recipe, cache, length_reward, ray_cluster, tmp_path, capsys):
    run_dir = tmp_path / "run"
    # a reward model's scores differ between samples: every group has a signal without a second reward
    rewards = (["--reward-model-steps", "10"] if recipe == "reward_model"
               else [f"reward.functions=[{CHECKER[recipe]}, '{length_reward}:reward']"])
    assert main(["demo", "--recipe", recipe, "--run-dir", str(run_dir), "--cache-dir", str(cache), "--seed", "1",
                 *SMALL, *rewards]) == 0
    out = capsys.readouterr().out
    assert "[4/4] held-out evaluation (8 unseen prompts)" in out and "verdict: held-out greedy accuracy" in out
    assert ("tool_calls_per_trajectory (greedy)" in out) == (recipe == "tools")
    evals = read_metrics(run_dir, kind="eval")
    assert [r["step"] for r in evals] == [0, 1] and all(r["num_prompts"] == 8 for r in evals)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1]
    # the step trained, sent an update, and found it on every engine
    assert [r["sync_verified"] for r in rows] == [True], rows
    assert "weight sync verified at 1 of 1 steps" in out
    config = (run_dir / "config.yaml").read_text()
    assert "seed: 1" in config
    if recipe == "lora":
        assert "lora_rank: 16" in config and "lora_sync: adapter" in config and "placement: learner" in config
    if recipe == "async":
        assert "mode: async" in config
    if recipe == "tools":
        assert "env: calculator" in config and "tool_call_rate" in evals[-1]
    if recipe == "reward_model":  # built after the warm start, from it; the run scored by it alone
        rm = cache / "rm-warm-to0.25-seed1-threads1"
        assert "reward model from the warm start (10 Bradley-Terry steps on its own samples" in out
        assert yaml.safe_load(config)["reward"]["functions"] == [f"model:{rm}"]
        assert all("rewards/addition_rm/mean" in r for r in rows), rows[0].keys()
    if recipe == "chat":
        first = json.loads((cache / "data-chat" / "train.jsonl").read_text().splitlines()[0])
        assert first["prompt"][0]["role"] == "system" and "####" in first["answer"]
