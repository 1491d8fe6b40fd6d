"""`raygrpo plan` (cluster/plan/): the model's shape from config.json, the planner's choice and refusal,
--json's shape, --write's config, the command's exit codes. No actor starts: plans are arithmetic."""
import json

import pytest
import torch
import yaml

from cluster.cli import build_parser, main
from cluster.config import load_config
from cluster.plan.command import write_config
from cluster.plan.cost import Candidate, Workload, predict
from cluster.plan.hardware import ClusterSpecError, parse_cluster
from cluster.plan.profile import CalibrationProfile, MeasuredSpeeds, SpecSpeeds
from cluster.plan.published import RUNS, predicted, table
from cluster.plan.shapes import PUBLISHED, read_shape, shape_from_config

KEYS = ("step_s", "phases", "learner_peak_bytes")


def test_shape_from_config_json_counts_the_parameters_the_model_has(tmp_path):
    """A Qwen2 (q/k/v biases, untied head) and its tied variant: the count from config.json alone equals the
    built model's."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    for tied in (False, True):
        cfg = Qwen2Config(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=96, vocab_size=300, tie_word_embeddings=tied)
        with torch.device("meta"):
            model = Qwen2ForCausalLM(cfg)
        real = sum(p.numel() for p in model.parameters())  # tied weights counted once
        cfg.save_pretrained(tmp_path / f"m{tied}")
        assert read_shape(tmp_path / f"m{tied}").params() == real


def test_a_mixture_of_experts_config_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="mixture of experts"):
        shape_from_config({"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1, "intermediate_size": 8,
                           "vocab_size": 8, "num_experts": 8})


def test_cluster_specs():
    c = parse_cluster("2x8xH100")
    assert (c.num_nodes, c.total_devices, c.device.memory_bytes) == (2, 16, 80e9)
    assert "published spec" in c.device.source
    assert parse_cluster("1x8xh200", efficiency=0.3).efficiency.compute == 0.3
    for bad in ("16xH100", "2x8xTPU", ""):
        with pytest.raises(ClusterSpecError):
            parse_cluster(bad)
    with pytest.raises(ClusterSpecError, match="efficiency.compute"):
        parse_cluster("1x8xH100", efficiency=1.5)


def test_yaml_cluster_spec(tmp_path):
    spec = tmp_path / "c.yaml"
    spec.write_text("efficiency: {memory: 0.5}\nnodes:\n  - {count: 2, device: A100-80GB, devices: 4}\n"
                    "  - {name: mine, devices: 2, device_memory_gb: 24, bf16_tflops: 100, hbm_gbps: 900}\n")
    c = parse_cluster(str(spec))
    assert c.total_devices == 10 and c.efficiency.memory == 0.5
    assert c.device.memory_bytes == 24e9 and "given in" in c.device.source  # the smallest device bounds the plan


def _config(tmp_path, text: str) -> str:
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return str(p)


GSM = """model: {path: Qwen2.5-7B}
trainer: {prompts_per_step: 64, group_size: 8, mode: sync}
rollout: {num_workers: 1, num_gpus: 1, max_model_len: 2048, max_new_tokens: 1024, gpu_memory_utilization: 0.85}
learner: {num_ranks: 1, num_gpus: 1, micro_batch_size: 8}
reward: {functions: [exact_match]}
"""


def test_json_has_as_given_and_recommended_with_overrides(tmp_path, capsys):
    assert main(["plan", _config(tmp_path, GSM), "--cluster", "1x8xH100", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for side in ("as_given", "recommended"):
        assert all(k in out[side] for k in KEYS), out[side].keys()
        ph, mode = out[side]["phases"], out[side]["placement"]["mode"]
        # the learner's view of a step: its own work, its wait for a batch, the update (sync: every phase in a row)
        learner_view = ph["training"] + ph["wait_learner"] + ph["weight_sync"]
        if mode == "sync":
            learner_view += ph["generation"] + ph["reward"] + ph["reference"]
        elif out[side]["placement"]["reference"] == "learner":
            learner_view += ph["reference"]
        assert out[side]["step_s"] == pytest.approx(learner_view)
    assert out["recommended"]["overrides"] and all("=" in o for o in out["recommended"]["overrides"])
    # one learner rank of a 7B model at ZeRO-0 does not fit an H100: the as-given plan says so
    assert not out["as_given"]["fits"] and any("learner" in p for p in out["as_given"]["problems"])
    assert out["recommended"]["fits"] and out["recommended"]["step_s"] < out["as_given"]["step_s"]


def test_write_gives_a_config_that_loads_and_holds_the_plan(tmp_path, capsys):
    out = tmp_path / "planned.yaml"
    assert main(["plan", _config(tmp_path, GSM), "trainer.steps=7", "--cluster", "1x8xH100", "--json",
                 "--write", str(out)]) == 0
    rec = json.loads(capsys.readouterr().out)["recommended"]
    cfg = load_config(out, validate_paths=False)  # through the project's own loader: every check passes
    c = rec["placement"]
    assert (cfg.rollout.num_workers, cfg.learner.num_ranks, cfg.learner.zero_stage, cfg.learner.micro_batch_size,
            cfg.trainer.mode) == (c["engines"], c["ranks"], c["zero_stage"], c["micro_batch"], c["mode"])
    assert cfg.trainer.steps == 7 and cfg.rollout.max_new_tokens == 1024  # the user's and the file's own keys kept


def test_write_refuses_overrides_that_do_not_load(tmp_path):
    with pytest.raises(ValueError, match="learner.zero_stage"):
        write_config(_config(tmp_path, GSM), [], ["learner.zero_stage=7"], tmp_path / "x.yaml")


def test_a_cluster_on_which_nothing_fits_is_refused_with_the_reason(tmp_path, capsys):
    """A 7B model on two 24 GB GPUs: 15 GB of weights leave an engine no room at any utilisation we plan with,
    and a learner's states alone are over 24 GB per device."""
    spec = tmp_path / "small.yaml"
    spec.write_text("nodes:\n  - {name: small, devices: 2, device_memory_gb: 24, bf16_tflops: 100, hbm_gbps: 900}\n")
    assert main(["plan", _config(tmp_path, GSM), "rollout.gpu_memory_utilization=0.5", "--cluster", str(spec)]) == 2
    err = capsys.readouterr().err
    assert "nothing fits" in err and "GB" in err and ("engine" in err or "learner" in err)
    assert "Traceback" not in err


@pytest.mark.parametrize("argv,message", [
    (["--cluster", "3xH100"], "--cluster '3xH100'"),
    (["--cluster", "local", "--profile", "/nonexistent.json"], "bench --calibrate"),
    (["model.path=/nowhere", "--cluster", "1x8xH100"], "model.path"),
    (["trainer.group_size=x", "--cluster", "1x8xH100"], "trainer.group_size"),
])
def test_bad_input_exits_2_naming_the_problem(tmp_path, capsys, argv, message):
    assert main(["plan", _config(tmp_path, GSM), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_plan_has_help():
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["plan", "--help"])
    assert e.value.code == 0


def _profile(params: int) -> CalibrationProfile:
    return CalibrationProfile(machine="test", cores=2, model="tiny", model_params=params, dtype_bytes=4,
                              generation=[{"batch": 1, "tokens_per_s": 100.0}, {"batch": 16, "tokens_per_s": 800.0}],
                              learner=[{"micro_batch": 1, "seq_len": 64, "tokens_per_s": 1000.0, "peak_bytes": 2e8},
                                       {"micro_batch": 8, "seq_len": 64, "tokens_per_s": 4000.0, "peak_bytes": 6e8}],
                              sync_bytes_per_s=1e9, sync_overhead_s=0.01, reward_s_per_completion=1e-4)


def test_measured_speeds_interpolate_and_scale_by_parameters():
    shape = PUBLISHED["SmolLM2-135M-Instruct"]
    same = MeasuredSpeeds(_profile(shape.params()), shape)
    assert same.decode_tokens_per_s(4, 64) == pytest.approx(100 * 4 ** (3 / 4))  # log-log between (1,100), (16,800)
    assert same.train_s(1000, 8, False) == pytest.approx(0.25)
    half = MeasuredSpeeds(_profile(shape.params() // 2), shape)
    assert half.train_s(1000, 8, False) == pytest.approx(0.5, rel=1e-3) and "scaled" in half.source


def test_schedules_order_their_step_times():
    """sync pays every phase in a row; async overlaps generation with training; pipeline also hides the tail."""
    shape, cluster = PUBLISHED["Qwen2.5-7B"], parse_cluster("2x8xH100")
    wl = Workload(prompts=256, group=16, prompt_tokens=256, mean_new_tokens=1024, max_new_tokens=4096, max_model_len=4608,
                  mu=1, beta=0.0, max_staleness=1, dtype_bytes=2, gpu_memory_utilization=0.85, eager=False)
    speeds = SpecSpeeds(cluster, shape)
    for engines in (8, 1):  # learner-bound, then generation-bound (where the tail shows)
        steps = {}
        for mode in ("sync", "async", "pipeline"):
            c = Candidate(engines=engines, tp=1, ranks=8, zero_stage=2, micro_batch=4, mode=mode, gradient_checkpointing=True)
            pr = predict(shape, wl, c, speeds, 80e9, 8, 16)
            steps[mode] = pr.step_s
            assert pr.fits, pr.problems
        assert steps["sync"] > steps["async"] >= steps["pipeline"]
    assert steps["async"] > steps["pipeline"]


def test_local_plan_reads_the_calibration(tmp_path, capsys):
    shape = PUBLISHED["SmolLM2-135M-Instruct"]
    prof = _profile(shape.params()).save(tmp_path / "p.json")
    cfg = _config(tmp_path, "model: {path: SmolLM2-135M-Instruct}\nreward: {functions: [exact_match]}\n")
    assert main(["plan", cfg, "--cluster", "local", "--profile", str(prof), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "measured" in out["as_given"]["sources"][0]
    written = yaml.safe_load(json.dumps(out["recommended"]["overrides"]))
    assert not any(k.startswith(("rollout.num_gpus", "learner.num_gpus")) for k in written)  # CPU: no GPU keys


def test_the_recommendation_is_one_the_config_check_accepts(tmp_path, capsys):
    """Pipeline mode refuses evaluations during training: with trainer.eval_every set, the plan never
    recommends it, and --write's file loads."""
    out = tmp_path / "planned.yaml"
    argv = ["plan", _config(tmp_path, GSM), "trainer.eval_every=5", "--cluster", "1x8xH100", "--json", "--write", str(out)]
    assert main(argv) == 0
    rec = json.loads(capsys.readouterr().out)["recommended"]
    assert rec["placement"]["mode"] != "pipeline"
    assert load_config(out, validate_paths=False).trainer.eval_every == 5


def test_the_published_runs_table_is_computed_for_every_run():
    """docs/plan.md's table comes from cluster/plan/published.py: every run is predicted, none fitted."""
    rows = table()
    assert len(rows) == len(RUNS) + 2 and len({r.source for r in RUNS}) >= 3
    assert all(0 < predicted(r) < 1e5 for r in RUNS)
