"""Colocated candidates (cluster/plan/search.py): learner rank i and engine i on one device, both resident,
time-sliced, the update through host memory. The planner weighs them beside separate placements, picks one
where it is the one that fits, and refuses with the reason where nothing does."""
import json

import pytest

from cluster.cli import main
from cluster.config import load_config
from cluster.plan.cost import Candidate, Workload, predict
from cluster.plan.hardware import parse_cluster
from cluster.plan.profile import SpecSpeeds
from cluster.plan.search import PlanRefused, overrides, search
from cluster.plan.shapes import PUBLISHED

SMALL = PUBLISHED["Qwen2.5-0.5B-Instruct"]


def _wl(util=0.3, prompts=16) -> Workload:
    return Workload(prompts=prompts, group=8, prompt_tokens=128, mean_new_tokens=256, max_new_tokens=512,
                    max_model_len=1024, mu=1, beta=0.0, max_staleness=1, dtype_bytes=2, gpu_memory_utilization=util,
                    eager=False)


def _given(colocate=False) -> Candidate:
    return Candidate(engines=1, tp=1, ranks=1, zero_stage=1, micro_batch=4, mode="sync", colocate=colocate)


def test_one_device_the_planner_picks_a_colocated_pair():
    """On one GPU a separate engine and learner need two devices: the only candidates that fit are colocated."""
    cluster = parse_cluster("1x1xH100")
    plan = search(SMALL, _wl(), SpecSpeeds(cluster, SMALL), cluster, _given())
    assert plan.recommended.candidate.colocate
    assert all(p.candidate.colocate for p in plan.weighed)  # a separate pair cannot even be formed
    win = plan.recommended
    # time-sliced: nothing overlaps, the step is every phase in a row
    ph = win.phases
    assert win.step_s == pytest.approx(ph["generation"] + ph["reward"] + ph["reference"] + ph["training"]
                                       + ph["weight_sync"] + ph["overhead"])
    ovr = overrides(win.candidate)
    assert {"ray.placement=colocate", "rollout.weight_transfer_backend=gloo", "rollout.tensor_parallel_size=1"} <= set(ovr)


def test_colocated_and_separate_are_weighed_side_by_side():
    cluster = parse_cluster("1x2xH100")
    plan = search(SMALL, _wl(), SpecSpeeds(cluster, SMALL), cluster, _given())
    kinds = {p.candidate.colocate for p in plan.weighed}
    assert kinds == {True, False}
    best = {k: min(p.step_s for p in plan.weighed if p.candidate.colocate == k) for k in kinds}
    # two devices colocated (two engines, two ranks) against one engine + one rank: both weighed, the faster wins
    assert plan.recommended.step_s == pytest.approx(min(best.values()))


def test_a_colocated_learner_gets_the_device_less_the_engines_share():
    """The same learner fits a device alone but not beside an engine holding 80% of it."""
    cluster = parse_cluster("1x2xH100")
    speeds = SpecSpeeds(cluster, SMALL)
    c = Candidate(engines=1, tp=1, ranks=1, zero_stage=1, micro_batch=32, mode="sync")
    alone = predict(SMALL, _wl(util=0.8), c, speeds, 80e9, 2, 2, headroom=0.9)
    together = predict(SMALL, _wl(util=0.8), Candidate(**{**c.__dict__, "colocate": True}), speeds, 80e9, 2, 2, headroom=0.9)
    assert alone.fits and 0.1 * 80e9 < together.learner.peak < 0.9 * 80e9
    assert not together.fits and any("learner" in p for p in together.problems)
    # its update goes through host memory: slower than NVLink
    assert together.phases["weight_sync"] > alone.phases["weight_sync"]


def test_nothing_fits_one_small_device_and_the_refusal_says_why(tmp_path):
    """One 24 GB GPU and a 7B model: 15 GB of weights for the engine leave the learner no room beside it."""
    yml = tmp_path / "one.yaml"
    yml.write_text("nodes:\n  - {name: small, devices: 1, device_memory_gb: 24, bf16_tflops: 100, hbm_gbps: 900}\n")
    cluster = parse_cluster(str(yml))
    spec = PUBLISHED["Qwen2.5-7B"]
    with pytest.raises(PlanRefused, match="nothing fits") as e:
        search(spec, _wl(util=0.5), SpecSpeeds(cluster, spec), cluster, _given())
    assert "colocated" in str(e.value) and "GB" in str(e.value)


def test_the_written_colocated_plan_loads(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model: {path: Qwen2.5-0.5B-Instruct}\ntrainer: {prompts_per_step: 16, group_size: 8}\n"
                   "rollout: {num_workers: 1, num_gpus: 1, max_model_len: 1024, max_new_tokens: 512, "
                   "gpu_memory_utilization: 0.3}\nlearner: {num_ranks: 1, num_gpus: 1, micro_batch_size: 4}\n"
                   "reward: {functions: [exact_match]}\n")
    out = tmp_path / "planned.yaml"
    assert main(["plan", str(cfg), "--cluster", "1x1xH100", "--json", "--write", str(out)]) == 0
    rec = json.loads(capsys.readouterr().out)["recommended"]
    assert rec["placement"]["colocate"] and "ray.placement=colocate" in rec["overrides"]
    loaded = load_config(out, validate_paths=False)
    assert loaded.ray.placement == "colocate" and loaded.rollout.weight_transfer_backend == "gloo"
