"""Unknown config keys: TRL/verl names refused with the raygrpo key, everything else "did you mean"."""
import re

import pytest

from cluster.cli import main
from cluster.config import ConfigError, RunConfig, _dotted_keys, load_config
from cluster.config_names import FOREIGN_NAMES

ISSUE_NAMES = ["num_generations", "epsilon", "epsilon_high", "loss_type", "report_to", "max_completion_length",
               "per_device_train_batch_size"]


def problems(*overrides):
    with pytest.raises(ConfigError) as e:
        load_config(None, list(overrides), validate_paths=False)
    return e.value.problems


@pytest.mark.parametrize("name", ISSUE_NAMES)
def test_the_trl_names_users_type_most_are_refused_with_the_raygrpo_key(name):
    (problem,) = problems(f"{name}=1")
    ours = FOREIGN_NAMES[name][1]
    assert problem.startswith(f"unknown key {name}: {name} is TRL's name; raygrpo calls it {ours}")


def test_every_raygrpo_key_the_mapping_names_exists():
    """The README table and the refusals name keys; none of them may drift from the config."""
    keys = set(_dotted_keys(RunConfig))
    for name, (_, ours, _) in FOREIGN_NAMES.items():
        named = re.findall(r"\b[a-z]+\.[a-z_]+\b", ours)
        assert named and set(named) <= keys, (name, named)


def test_other_unknown_keys_get_did_you_mean():
    assert problems("trainer.stepz=3") == ["unknown key trainer.stepz: did you mean trainer.steps?"]
    assert problems("trainer.lr=1e-6") == ["unknown key trainer.lr: did you mean learner.lr?"]
    assert problems("beta=0.04") == ["unknown key beta: did you mean algo.beta?"]  # TRL's flat config
    assert problems("trainers.steps=2") == ["unknown key trainers: did you mean trainer?"]
    (far,) = problems("trainer.xyzzy=1")
    assert far.startswith("unknown key trainer.xyzzy (known in trainer: actor_timeout_s,")
    assert problems("rollout.n=8") == ["unknown key rollout.n: n is verl's name; raygrpo calls it trainer.group_size "
                                       "(verl's actor_rollout_ref.rollout.n)"]


def test_through_the_cli_every_problem_in_one_message(tmp_path, capsys):
    cfg = tmp_path / "trl_style.yaml"
    cfg.write_text("num_generations: 8\nepsilon_high: 0.28\ntrainer: {stepz: 3}\n")
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "has 4 problem(s)" in err  # the three names + model.path empty
    assert "num_generations is TRL's name; raygrpo calls it trainer.group_size" in err
    assert "epsilon_high is TRL's name; raygrpo calls it algo.clip_high" in err
    assert "unknown key trainer.stepz: did you mean trainer.steps?" in err and "Traceback" not in err


def test_verls_nested_keys_are_answered_whole_from_the_command_line_and_from_yaml(tmp_path):
    assert problems("actor_rollout_ref.rollout.n=8") == [
        "unknown key actor_rollout_ref.rollout.n: actor_rollout_ref.rollout.n is verl's name; "
        "raygrpo calls it trainer.group_size"]
    run = tmp_path / "verl.yaml"
    run.write_text("algorithm: {adv_estimator: grpo}\nactor_rollout_ref:\n  actor: {optim: {lr: 1.0e-6}, foo: 1}\n")
    with pytest.raises(ConfigError) as e:
        load_config(run, validate_paths=False)
    assert e.value.problems == [
        "unknown key algorithm.adv_estimator: algorithm.adv_estimator is verl's name; "
        "raygrpo calls it algo.advantage_estimator",
        "unknown key actor_rollout_ref.actor.optim.lr: did you mean learner.lr?",
        "unknown key actor_rollout_ref.actor.foo (no raygrpo key of that name)"]
    # a mapping under a misspelt raygrpo section is still that section misspelt
    assert problems("trainers.steps=2", "trainers.group_size=4") == ["unknown key trainers: did you mean trainer?"]
