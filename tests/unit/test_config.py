import json
import re
import struct

import pytest
import yaml

from cluster.config import ConfigError, RunConfig, load_config, save_config


def write(tmp_path, data):
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def write_safetensors(path, n_floats=4, truncate_by=0):
    header = json.dumps({"w": {"dtype": "F32", "shape": [n_floats], "data_offsets": [0, 4 * n_floats]}}).encode()
    data = struct.pack("<Q", len(header)) + header + b"\0" * (4 * n_floats)
    path.write_bytes(data[:len(data) - truncate_by])


def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text("{}")
    write_safetensors(d / "model.safetensors")
    return str(d)


def test_defaults_come_from_the_dataclasses(tmp_path):
    cfg = load_config(write(tmp_path, {"model": {"path": model_dir(tmp_path)}}))
    assert cfg.trainer.group_size == RunConfig().trainer.group_size
    assert cfg.learner.zero_stage == 0  # auto, one rank


@pytest.mark.parametrize(("learner", "stage"), [
    ({}, 0),  # one rank: nothing to partition
    ({"num_ranks": 2}, 2),
    ({"offload_optimizer": True}, 2),  # DeepSpeed offloads the optimizer of ZeRO only
    ({"zero_stage": 2}, 2),  # what the user wrote is kept
    ({"num_ranks": 2, "zero_stage": 0}, 0),
    ({"zero_stage": "auto", "num_ranks": 4}, 2),
])
def test_zero_stage_auto_is_0_on_one_rank_and_2_with_more(tmp_path, learner, stage):
    cfg = load_config(write(tmp_path, {"model": {"path": model_dir(tmp_path)}, "learner": learner}))
    assert cfg.learner.zero_stage == stage
    saved = tmp_path / "saved.yaml"  # a run dir's config.yaml holds the stage the run used
    save_config(cfg, saved)
    assert yaml.safe_load(saved.read_text())["learner"]["zero_stage"] == stage


@pytest.mark.parametrize(("learner", "says"), [
    ({"zero_stage": "two"}, "learner.zero_stage must be auto, 0, 1, 2 or 3, got 'two'"),
    ({"zero_stage": 0, "offload_optimizer": True}, "learner.offload_optimizer needs learner.zero_stage 1, 2 or 3"),
])
def test_a_zero_stage_that_cannot_run_is_named(tmp_path, learner, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_config(write(tmp_path, {"model": {"path": model_dir(tmp_path)}, "learner": learner}))


def test_dotted_overrides_parse_yaml_values(tmp_path):
    cfg = load_config(
        write(tmp_path, {"model": {"path": model_dir(tmp_path)}}),
        ["trainer.steps=50", 'rollout.stop=["\\n"]', "algo.tis_cap=null", "learner.lr=3e-4"],
    )
    assert cfg.trainer.steps == 50
    assert cfg.rollout.stop == ["\n"]
    assert cfg.algo.tis_cap is None
    assert cfg.learner.lr == pytest.approx(3e-4)


def test_every_problem_is_listed_in_one_error(tmp_path):
    path = write(tmp_path, {"model": {"path": model_dir(tmp_path)}, "trainer": {"group_size": 1, "stepz": 3}, "learner": {"lr": "fast"}})
    with pytest.raises(ConfigError) as e:
        load_config(path, ["learner.num_ranks=3", "rollout.temperature=-1"])
    text = str(e.value)
    # type and range problems come together, in one round
    assert "unknown key trainer.stepz" in text
    assert "learner.lr: expected a valid number" in text
    assert "group_size must be >= 2" in text
    assert "not divisible by learner.num_ranks = 3" in text
    assert "rollout.temperature must be >= 0" in text
    assert len(e.value.problems) == 5, e.value.problems


@pytest.mark.parametrize("override, message", [
    ("learner.lr=.nan", "learner.lr: expected a finite number"),
    ("learner.lr=.inf", "learner.lr: expected a finite number"),
    ("rollout.temperature=.nan", "rollout.temperature: expected a finite number"),
    ("rollout.top_p=0", "rollout.top_p must be in (0, 1]"),
    ("rollout.top_p=5", "rollout.top_p must be in (0, 1]"),
    ("learner.grad_clip=-1", "learner.grad_clip must be >= 0"),
    ("reward.fallback=.nan", "reward.fallback: expected a finite number"),
    ("reward.weights=[1.0, .inf]", "reward.weights[1]: expected a finite number"),
    ("trainer.eval_pass_k=-1", "trainer.eval_pass_k must be >= 0"),
    ("data.num_eval=-1", "data.num_eval must be >= 0"),
    ("rollout.bucket_mb=0", "rollout.bucket_mb must be >= 1"),
    ("rollout.num_cpus=-1", "rollout.num_cpus and rollout.num_gpus must be >= 0"),
    ("learner.num_gpus=-0.5", "learner.num_cpus and learner.num_gpus must be >= 0"),
    ("reference.num_cpus=-1", "reference.num_cpus and reference.num_gpus must be >= 0"),
    ("ray.num_cpus=-2", "ray.num_cpus must be >= 0"),
    ("learner.adam_beta2=1.0", "learner.adam_beta2 must be in [0, 1)"),
    ("trainer.run_dir=", "trainer.run_dir is empty"),
    ("trainer.halt_after=-1", "trainer.halt_after must be >= 0"),
    ("trainer.kl_ceiling=.nan", "trainer.kl_ceiling: expected a finite number"),
    ("checkpoint.resume=/no/such/ckpt", "no such checkpoint directory"),
    ("rollout.min_workers=0", "rollout.min_workers must be in [1, rollout.num_workers (1)], got 0"),
    ("rollout.min_workers=2", "rollout.min_workers must be in [1, rollout.num_workers (1)], got 2"),
    ("ray.node_wait_s=0", "ray.node_wait_s must be > 0"),
])
def test_out_of_range_and_nonfinite_values_are_named(tmp_path, override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"model.path={model_dir(tmp_path)}", override])
    assert message in str(e.value)


def test_min_workers_defaults_to_num_workers(tmp_path):
    cfg = load_config(None, [f"model.path={model_dir(tmp_path)}", "rollout.num_workers=3"])
    assert cfg.rollout.min_workers is None and cfg.rollout.min_live_workers() == 3
    cfg = load_config(None, [f"model.path={model_dir(tmp_path)}", "rollout.num_workers=3", "rollout.min_workers=1",
                             "trainer.prompts_per_step=4"])
    assert cfg.rollout.min_live_workers() == 1


def test_resume_path_is_verified_like_auto(tmp_path):
    ckpt = tmp_path / "step-00000002"
    ckpt.mkdir()
    (ckpt / "driver_state.json").write_text("{}")  # no COMPLETE manifest: a save that never finished
    with pytest.raises(ConfigError, match="no COMPLETE marker"):
        load_config(None, [f"model.path={model_dir(tmp_path)}", f"checkpoint.resume={ckpt}"])


def test_model_dir_needs_weights_whose_headers_parse(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="holds no weights"):
        load_config(None, [f"model.path={d}"])
    write_safetensors(d / "model.safetensors", truncate_by=3)
    with pytest.raises(ConfigError, match="model.safetensors is truncated"):
        load_config(None, [f"model.path={d}"])
    (d / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ConfigError, match="truncated|not a valid safetensors"):
        load_config(None, [f"model.path={d}"])
    write_safetensors(d / "model.safetensors")
    assert load_config(None, [f"model.path={d}"]).model.path == str(d)


def test_bool_is_not_an_int_and_int_is_a_float(tmp_path):
    m = model_dir(tmp_path)
    with pytest.raises(ConfigError, match="trainer.steps: expected a valid integer"):
        load_config(None, [f"model.path={m}", "trainer.steps=true"])
    assert load_config(None, [f"model.path={m}", "learner.lr=1"]).learner.lr == 1.0


def test_missing_model_and_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(None, [f"model.path={tmp_path}/nope"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_bad_override_syntax(tmp_path):
    with pytest.raises(ConfigError, match="not KEY=VALUE"):
        load_config(None, [f"model.path={model_dir(tmp_path)}", "trainer.steps"])


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, [f"model.path={model_dir(tmp_path)}", "trainer.steps=7"])
    save_config(cfg, tmp_path / "resolved.yaml")
    assert load_config(tmp_path / "resolved.yaml") == cfg


def test_an_override_yaml_would_cut_at_a_comment_is_taken_whole(tmp_path):
    """Issue 30 case 12: `data.system_prompt=Solve it. End with #### and the number.` became "Solve it. End with"."""
    model = f"model.path={model_dir(tmp_path)}"
    cfg = load_config(None, [model, "data.system_prompt=Solve it. End with #### and the number.",
                             "rollout.stop=['#', ' #']"])
    assert cfg.data.system_prompt == "Solve it. End with #### and the number."
    assert cfg.rollout.stop == ["#", " #"]  # quoted: YAML reads no comment there, so YAML's value stands
    assert load_config(None, [model, "data.system_prompt=#1 rule: be brief"]).data.system_prompt == "#1 rule: be brief"
    with pytest.raises(ConfigError, match="trainer.steps: expected a valid integer"):  # taken whole, so never silently 50
        load_config(None, [model, "trainer.steps=50 # fifty"])


def test_zero_learner_ranks_is_a_config_error_not_a_division_by_zero(tmp_path):
    """Issue 30 case 11: learner.num_ranks=0 gave "integer modulo by zero"."""
    with pytest.raises(ConfigError, match="learner.num_ranks must be >= 1, got 0"):
        load_config(None, [f"model.path={model_dir(tmp_path)}", "learner.num_ranks=0"])
