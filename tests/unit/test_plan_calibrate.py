"""`raygrpo bench --calibrate`'s measurements (cluster/bench/calibrate.py) and the profile they make.
The generation part needs a vLLM engine (tens of seconds here): it runs in `raygrpo bench --calibrate`
itself (docs/plan.md has its figures), not in this unit tier."""
import time

import pytest

from cluster.bench import command
from cluster.bench.calibrate import PeakRss, measure_learner, measure_reward, measure_sync, speedup_of_runs
from cluster.cli import build_parser
from cluster.models.tinymodel import TinyModelSpec, build_tiny_model
from cluster.plan.profile import CalibrationProfile, MeasuredSpeeds, ProfileError
from cluster.plan.shapes import PUBLISHED


def test_peak_rss_sees_an_allocation_inside_the_block():
    with PeakRss() as p:
        before = p.peak
        block = bytearray(64 * 2**20)
        block[::4096] = b"x" * len(block[::4096])  # touch every page
        time.sleep(0.05)  # held longer than the sampler's 2 ms period
        del block
    assert p.peak - before >= 48 * 2**20


def test_learner_points_grow_with_the_micro_batch(tmp_path):
    model = build_tiny_model(tmp_path / "m", TinyModelSpec(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                                                           intermediate_size=128))
    pts, speedup = measure_learner(str(model), threads=1, cores=2)
    assert [p["micro_batch"] for p in pts] == sorted(p["micro_batch"] for p in pts)
    assert all(p["tokens_per_s"] > 0 for p in pts)
    assert pts[-1]["peak_bytes"] > pts[0]["peak_bytes"] > 0  # more sequences, more activations
    assert speedup > 0  # at 2 threads against 1 (on a loaded machine it may be under 1)
    assert measure_learner(str(model), threads=1)[1] == 1.0  # not asked: not measured


def test_sync_measures_a_rate_and_a_floor():
    res = measure_sync(8 * 2**20)
    assert res["bytes_per_s"] > 1e6 and 0 < res["overhead_s"] < 1


def test_reward_cost_of_the_builtins():
    assert measure_reward(["exact_match"], n=200) > 0
    assert measure_reward(["not-a-builtin"], n=10) == 0.0


def test_profile_round_trip_and_an_incomplete_one_refused(tmp_path):
    prof = CalibrationProfile(machine="m", cores=2, model="x", model_params=10, dtype_bytes=4,
                              generation=[{"batch": 1, "tokens_per_s": 1.0}],
                              learner=[{"micro_batch": 1, "tokens_per_s": 1.0, "peak_bytes": 1}], sync_bytes_per_s=1.0)
    assert CalibrationProfile.load(prof.save(tmp_path / "p.json")) == prof
    prof.generation = []
    with pytest.raises(ProfileError, match="calibrate again"):
        CalibrationProfile.load(prof.save(tmp_path / "q.json"))


def test_bench_calibrate_runs_the_calibration_instead_of_the_parts(monkeypatch):
    """`raygrpo bench --calibrate FILE` goes to run_calibrate before any part (or Ray) starts."""
    seen = []
    monkeypatch.setattr(command, "run_calibrate", lambda args: seen.append(args.calibrate) or 0)
    args = build_parser().parse_args(["bench", "--calibrate", "/tmp/x.json"])
    assert command.run_bench(args) == 0 and seen == ["/tmp/x.json"]
    assert build_parser().parse_args(["bench", "--calibrate"]).calibrate == "runs/calibrate/profile.json"


def test_a_runs_thread_speedup_is_its_phases_at_one_thread_over_at_the_budgets():
    """The fit run pinned to the points' thread and again at the thread budget's: the speed-up a run's phases
    get replaces the plain points' (kept beside it), and a plan's thread factor follows it."""
    points = {"generation": 1.0, "learner": 1.77, "threads": 2}
    sp = speedup_of_runs({"gen_s": 0.18, "train_s": 0.15}, {"gen_s": 0.18, "train_s": 0.125}, 2, points)
    assert sp["learner"] == pytest.approx(1.2) and sp["generation"] == pytest.approx(1.0)
    assert sp["threads"] == 2 and sp["points"] == points and sp["measured_on"] == "runs"
    shape = PUBLISHED["SmolLM2-135M-Instruct"]
    prof = CalibrationProfile(machine="m", cores=2, model="x", model_params=shape.params(), dtype_bytes=4,
                              generation=[{"batch": 1, "tokens_per_s": 1.0}], sync_bytes_per_s=1.0, threads=1,
                              learner=[{"micro_batch": 1, "tokens_per_s": 1.0, "peak_bytes": 1}], thread_speedup=sp)
    assert MeasuredSpeeds(prof, shape).thread_factor("learner", 2) == pytest.approx(1 / 1.2)
