"""Issue 36 case 6: the README's LoRA reference rule and the example configs agree. The README says no
reference actor starts under LoRA with algo.beta > 0 unless reference.placement is `actor` (or
learner.lora_reference_actor=true); examples/cpu_demo.yaml sets `actor`, and with LoRA on it one started."""
from pathlib import Path

import pytest

from cluster.config import load_config
from cluster.demo.recipes import RECIPES
from cluster.paths import PROJECT_ROOT

EXAMPLES = sorted((PROJECT_ROOT / "examples").glob("*.yaml"))
README = (PROJECT_ROOT / "README.md").read_text()


def reference_actor_starts(cfg) -> bool:
    return cfg.algo.beta > 0 and not cfg.reference_on_learner()


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_lora_on_every_example_follows_the_readme_rule(example: Path):
    cfg = load_config(example, ["learner.lora_rank=16", "algo.beta=0.01"], validate_paths=False)
    expected = cfg.reference.placement == "actor" or cfg.learner.lora_reference_actor
    assert reference_actor_starts(cfg) == expected, (example.name, cfg.reference.placement)
    auto = load_config(example, ["learner.lora_rank=16", "algo.beta=0.01", "reference.placement=auto"],
                       validate_paths=False)
    assert not reference_actor_starts(auto)
    # On a GPU example the actor gets a GPU share: auto never puts a GPU run's reference on CPU (issue 57).
    ref_gpus = ["reference.num_gpus=0.1"] if cfg.learner.num_gpus > 0 else []
    with_flag = load_config(example, ["learner.lora_rank=16", "algo.beta=0.01", "reference.placement=auto",
                                      "learner.lora_reference_actor=true", *ref_gpus], validate_paths=False)
    assert reference_actor_starts(with_flag)


def test_the_readme_states_the_rule_with_the_example_that_sets_actor():
    text = " ".join(README.split())
    assert "With `algo.beta > 0` and `reference.placement: auto` (the default) the reference is the learner's own " \
           "model with its adapters off: no reference actor starts." in text
    assert "An explicit `reference.placement: actor` (examples/cpu_demo.yaml sets it" in text
    cpu_demo = load_config(PROJECT_ROOT / "examples" / "cpu_demo.yaml", ["learner.lora_rank=16"], validate_paths=False)
    assert cpu_demo.reference.placement == "actor" and reference_actor_starts(cpu_demo)


def test_the_lora_recipe_starts_no_reference_actor():
    recipe = RECIPES["lora"]
    cfg = load_config(recipe.config, list(recipe.overrides), validate_paths=False)
    assert cfg.learner.lora and cfg.algo.beta > 0 and not reference_actor_starts(cfg)
