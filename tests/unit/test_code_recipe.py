"""`raygrpo demo --recipe code` without engines: registered, its data from the project's own builder
(cluster/models/codetasks.py) with a held-out split whose functions are never trained on, every reference
solution passing its tests through the recipe's own reward config, and a config that loads. Its learning
check (held-out pass rate, seeds 0-2) needs the real model trained for minutes and is not a unit test."""
from __future__ import annotations

import json

from actors.rewards.scorer import RewardScorer
from actors.runtime.sandbox import probe
from cluster.config import load_config
from cluster.demo.recipes import RECIPES
from cluster.models.codetasks import HELD_OUT_CONSTANTS, KINDS, TRAIN_CONSTANTS, code_task


def test_the_code_recipe_is_registered_on_smollm2_without_a_warm_start():
    recipe = RECIPES["code"]
    assert recipe.base == "smollm2" and recipe.warm_start is None
    cfg = load_config(recipe.config, ["model.path=/nonexistent", *recipe.overrides], validate_paths=False)
    assert cfg.reward.functions == ["code_tests"] and cfg.reward.code_format == "mbpp"
    assert cfg.reward.code_sandbox == "strict"


def test_its_held_out_functions_are_never_trained_on(tmp_path):
    train, held = (o.split("=", 1)[1] for o in RECIPES["code"].write_data(tmp_path))
    rows = [json.loads(line) for line in open(train)]
    held_rows = [json.loads(line) for line in open(held)]
    assert len(rows) == 5000 and len(held_rows) == 400
    trained = {r["function"] for r in rows}
    assert trained and not trained & {r["function"] for r in held_rows}
    assert {r["prompt"][-1]["role"] for r in rows} == {"user"} and all(r["test_list"] for r in held_rows)


def test_every_reference_solution_passes_and_a_wrong_one_does_not():
    tasks = [code_task(kind, k) for kind in KINDS for k in TRAIN_CONSTANTS + HELD_OUT_CONSTANTS]
    cfg = load_config(RECIPES["code"].config, ["model.path=/nonexistent",
                                               f"reward.code_sandbox={'strict' if probe('strict') is None else 'process'}"],
                      validate_paths=False)
    wrong = "```python\ndef f(x):\n    return x\n```"
    with RewardScorer(cfg.reward) as scorer:
        fields = [{k: v for k, v in t.items() if k != "prompt"} for t in tasks]
        result = scorer.score([t["prompt"] for t in tasks] + [tasks[0]["prompt"]],
                              [t["solution"] for t in tasks] + [wrong], fields + [fields[0]])
    assert result.rewards[:-1] == [1.0] * len(tasks)
    assert result.rewards[-1] == 0.0 and result.tests[-1][0]["outcome"] == "error"  # add_2 is not defined
