"""`raygrpo plan --cluster local` (issue 62): the cores shared by the engines, the learner and the reference
(cluster/plan/cores.py), the thread scaling and the run fit of a calibration (profile.py, fit.py), and
the run probe's medians (cluster/bench/run_probe.py). No actor starts: a profile is written by hand."""
import pytest

from cluster.bench.run_probe import measured_of
from cluster.config import load_config
from cluster.plan.cores import contention_factor, local_threads, overlapped
from cluster.plan.fit import FitError, fit_run, predict_local
from cluster.plan.profile import CalibrationProfile, MeasuredSpeeds, call_and_token_costs
from cluster.plan.shapes import PUBLISHED

MODEL = "SmolLM2-135M-Instruct"


def _profile(**kw) -> CalibrationProfile:
    kw = {"thread_speedup": {"generation": 1.5, "learner": 1.8, "threads": 2},
          "generation": [{"batch": 1, "tokens_per_s": 50.0}, {"batch": 64, "tokens_per_s": 800.0}], **kw}
    return CalibrationProfile(machine="test", cores=2, model=MODEL, model_params=PUBLISHED[MODEL].params(), dtype_bytes=4,
                              learner=[{"micro_batch": 1, "seq_len": 64, "tokens_per_s": 200.0, "peak_bytes": 2e9},
                                       {"micro_batch": 16, "seq_len": 64, "tokens_per_s": 600.0, "peak_bytes": 3e9}],
                              sync_bytes_per_s=5e8, sync_overhead_s=0.001, reward_s_per_completion=1e-4, threads=1, **kw)


def _cfg(*overrides):
    base = ["model.path=" + MODEL, "data.train=task:addition", "trainer.prompts_per_step=8", "trainer.group_size=8",
            "rollout.max_new_tokens=32", "rollout.min_new_tokens=32", "rollout.max_model_len=96",
            "learner.micro_batch_size=16", "reward.functions=[exact_match]"]
    return load_config(None, [*base, *overrides], validate_paths=False)


def test_the_threads_a_run_gives_each_side():
    """sync: each phase takes both cores (two engines: one each); async and pipeline split them."""
    assert local_threads(1, 1, False, "sync", 2) == {"rollout": 2, "learner": 2, "reference": 2}
    assert local_threads(2, 1, False, "sync", 2)["rollout"] == 1
    assert local_threads(1, 1, False, "async", 2) == {"rollout": 1, "learner": 1, "reference": 1}
    assert local_threads(1, 1, True, "pipeline", 4)["learner"] == 2
    # rollout.threads / learner.threads pin a role, as in a run (the calibration's fit run pins both to 1)
    assert local_threads(1, 1, False, "sync", 2, (1, 1, 0)) == {"rollout": 1, "learner": 1, "reference": 1}


def test_overlapping_sides_contend_for_the_cores():
    assert overlapped("pipeline", 3.0, 5.0, 2.0) == 5.0  # no lending in pipeline: the slower side at its share
    assert overlapped("async", 5.0, 3.0, 2.0) == 5.0  # the learner finishes inside the collection
    # the learner did 2/4 of its work during the 2 s of collection, the rest at every core (half of 3 s)
    assert overlapped("async", 2.0, 4.0, 3.0) == pytest.approx(2.0 + 0.5 * 3.0)


def test_thread_factor_follows_amdahl_from_the_measured_speedup():
    shape = PUBLISHED[MODEL]
    perfect = MeasuredSpeeds(_profile(thread_speedup={"generation": 2.0, "learner": 1.0, "threads": 2}), shape)
    assert perfect.thread_factor("generation", 2) == pytest.approx(0.5)
    assert perfect.thread_factor("learner", 2) == pytest.approx(1.0)  # no speed-up measured: threads do not help
    s = MeasuredSpeeds(_profile(), shape)
    assert s.thread_factor("learner", 2) == pytest.approx(1 / 1.8) and s.thread_factor("learner", 1) == 1.0
    assert s.thread_factor("learner", 4) < 1 / 1.8  # beyond the measured cores, the same parallel share
    # more threads measured slower (busy cores): the time grows as measured, to 1 / s at every core
    slower = MeasuredSpeeds(_profile(thread_speedup={"generation": 0.5, "learner": 0.25, "threads": 2}), shape)
    assert slower.thread_factor("generation", 2) == pytest.approx(2.0) and slower.thread_factor("learner", 2) == 4.0
    assert slower.thread_factor("learner", 1) == 1.0
    unmeasured = MeasuredSpeeds(_profile(thread_speedup={}), shape)
    assert unmeasured.thread_factor("generation", 2) == pytest.approx(0.5)  # linear: an assumption, said in source


def test_async_overlaps_less_on_shared_cores_than_on_devices_of_their_own():
    """The same phases: on two cores async gains only what each side's thread scaling leaves (each side has one
    core instead of two), so it is slower than max(generation, training) of the sync run."""
    speeds = lambda s: MeasuredSpeeds(_profile(), s)  # noqa: E731
    sync = predict_local(_cfg(), speeds)[0]
    asyn = predict_local(_cfg("trainer.mode=async"), speeds)[0]
    pipe = predict_local(_cfg("trainer.mode=pipeline"), speeds)[0]
    ph = sync.phases
    assert asyn.step_s > max(ph["generation"], ph["training"]) + ph["weight_sync"]
    assert asyn.step_s < sync.step_s  # the learner takes the engine's core once the batch is collected
    assert asyn.phases["generation"] == pytest.approx(ph["generation"] * 1.5)  # one thread of the engine's two
    # pipeline lends nothing: its learner trains on one core all step, 1.8x its sync time, so on two cores a
    # learner-bound pipeline is slower than sync (what a thread-blind max(generation, training) hides)
    assert pipe.phases["training"] == pytest.approx(ph["training"] * 1.8)
    assert pipe.step_s == pytest.approx(max(pipe.phases["generation"], pipe.phases["training"]) + ph["weight_sync"])
    assert pipe.step_s > sync.step_s


def test_the_run_fit_reproduces_its_run_and_carries_to_other_configs():
    prof = _profile()
    cfg = _cfg()
    raw = predict_local(cfg, lambda s: MeasuredSpeeds(prof, s, use_run=False))[0]
    measured = {"step_s": 9.0, "gen_s": 2 * raw.phases["generation"], "train_s": 1.5 * raw.phases["training"],
                "sync_s": 0.8, "reward_s": 0.01, "ref_s": 0.0, "learner_peak_bytes": raw.learner.peak + 3e8}
    prof.run = fit_run(prof, cfg, measured, "fit")
    assert prof.run["generation_factor"] == pytest.approx(2.0) and prof.run["training_factor"] == pytest.approx(1.5)
    assert prof.run["overhead_s"] == pytest.approx(9.0 - measured["gen_s"] - measured["train_s"] - 0.8 - 0.01)
    fitted = predict_local(cfg, lambda s: MeasuredSpeeds(prof, s))[0]
    assert fitted.step_s == pytest.approx(9.0, rel=1e-6)  # the fit run itself, to rounding
    assert fitted.learner.peak == pytest.approx(measured["learner_peak_bytes"])
    assert fitted.phases["overhead"] == pytest.approx(prof.run["overhead_s"])
    other = predict_local(_cfg("rollout.num_workers=2"), lambda s: MeasuredSpeeds(prof, s))[0]
    assert other.phases["generation"] != pytest.approx(fitted.phases["generation"])  # predicted, not copied
    assert "fitted on a run" in MeasuredSpeeds(prof, PUBLISHED[MODEL]).source


def test_the_fit_needs_a_sync_run_with_steps():
    with pytest.raises(FitError, match="trainer.mode=async"):
        fit_run(_profile(), _cfg("trainer.mode=async"), {"step_s": 1.0})
    with pytest.raises(FitError, match="no step after the first"):
        fit_run(_profile(), _cfg(), {"step_s": 1.0, "gen_s": 0.0})


def test_another_model_is_scaled_and_the_source_says_which_calibration_to_run():
    s = MeasuredSpeeds(_profile(), PUBLISHED["Qwen2.5-0.5B-Instruct"])
    assert "scaled" in s.source and "bench --calibrate model.path=Qwen2.5-0.5B-Instruct" in s.source


def test_the_run_probe_takes_medians_after_the_first_step():
    rows = [{"kind": "train", "step_s": 30.0, "gen_s": 20.0, "train_s": 9.0, "learner_peak_bytes": 5.0},
            {"kind": "eval", "accuracy": 0.5},
            *({"kind": "train", "step_s": s, "gen_s": 1.0, "train_s": 2.0, "sync_s": None, "learner_peak_bytes": 7.0}
              for s in (3.0, 1.0, 2.0))]
    m = measured_of(rows)
    assert (m["steps"], m["step_s"], m["gen_s"], m["sync_s"], m["learner_peak_bytes"]) == (3, 2.0, 1.0, 0.0, 7.0)


def _two_length_points(fixed: float, step_s: float) -> list[dict]:
    """Generation points at 16 and 64 tokens per batch: a call takes `fixed` + length x `step_s` seconds."""
    return [{"batch": b, "new_tokens": n, "tokens_per_s": b * n / (fixed + n * step_s), "seconds": fixed + n * step_s}
            for b in (1, 64) for n in (16, 64)]


def test_a_generate_call_is_a_fixed_part_plus_its_decode_steps():
    """The points at two lengths separate a call's fixed seconds from its decode steps (call_and_token_costs)."""
    costs = call_and_token_costs(_two_length_points(0.5, 0.01))
    assert costs[64] == (pytest.approx(0.5), pytest.approx(64 / 0.01)) and costs[1][0] == pytest.approx(0.5)
    # one length per batch: no fixed part, the point's rate (what an old profile's points give)
    assert call_and_token_costs([{"batch": 4, "tokens_per_s": 80.0}]) == {4: (0.0, 80.0)}
    s = MeasuredSpeeds(_profile(generation=_two_length_points(0.5, 0.01)), PUBLISHED[MODEL])
    assert s.call_s(64) == pytest.approx(0.5) and s.decode_tokens_per_s(64, 0) == pytest.approx(6400)


def test_the_run_fit_carries_its_decode_factor_to_longer_completions_and_the_call_once():
    """The fit run (32 tokens) measured 0.3 s more than the points' 0.5 + 32 x 0.01: on the decode steps
    (0.32 -> 0.62 s, factor 1.9375), not on the call's fixed part; at 64 tokens the call is paid once, so the
    prediction is 0.5 + 1.9375 x 0.64, not the whole call x the factor (what one multiplicative factor gave)."""
    prof = _profile(generation=_two_length_points(0.5, 0.01))
    cfg = _cfg("trainer.prompts_per_step=8", "trainer.group_size=8", "rollout.threads=1", "learner.threads=1")
    raw = predict_local(cfg, lambda s: MeasuredSpeeds(prof, s, use_run=False))[0]
    assert raw.phases["generation"] == pytest.approx(0.5 + 32 * 0.01)
    measured = {"step_s": 5.0, "gen_s": raw.phases["generation"] + 0.3, "train_s": raw.phases["training"],
                "sync_s": raw.phases["weight_sync"], "learner_peak_bytes": None}
    prof.run = fit_run(prof, cfg, measured, "fit")
    assert prof.run["generation_call_s"] == pytest.approx(0.5)
    assert prof.run["generation_factor"] == pytest.approx(0.62 / 0.32)
    longer = _cfg("rollout.max_new_tokens=64", "rollout.min_new_tokens=64", "rollout.max_model_len=128",
                  "rollout.threads=1", "learner.threads=1")
    pr = predict_local(longer, lambda s: MeasuredSpeeds(prof, s))[0]
    assert pr.phases["generation"] == pytest.approx(0.5 + 0.62 / 0.32 * 0.64)
    assert pr.phases["generation"] < measured["gen_s"] * 64 / 32  # the single factor's over-carry, gone


def test_an_update_pays_each_engines_measured_share():
    """The fit's one-engine update less the raw broadcast is each engine's part: two engines pay it twice."""
    prof = _profile()
    cfg = _cfg("rollout.threads=1", "learner.threads=1")
    raw = predict_local(cfg, lambda s: MeasuredSpeeds(prof, s, use_run=False))[0]
    measured = {"step_s": 20.0, "gen_s": raw.phases["generation"], "train_s": raw.phases["training"],
                "sync_s": raw.phases["weight_sync"] + 0.4, "learner_peak_bytes": None}
    prof.run = fit_run(prof, cfg, measured, "fit")
    assert prof.run["update_s_per_engine"] == pytest.approx(0.4)
    two = predict_local(_cfg("rollout.num_workers=2"), lambda s: MeasuredSpeeds(prof, s))[0]
    assert two.phases["weight_sync"] == pytest.approx(raw.phases["weight_sync"] + 2 * 0.4)
    # a run's update faster than the calibration's broadcast: the difference, once (the fit run reproduced)
    prof.run = fit_run(prof, cfg, {**measured, "sync_s": raw.phases["weight_sync"] - 0.1}, "fit")
    assert predict_local(cfg, lambda s: MeasuredSpeeds(prof, s))[0].phases["weight_sync"] == pytest.approx(
        raw.phases["weight_sync"] - 0.1)


def test_training_beside_generating_engines_is_slowed_as_measured_and_by_the_fair_share():
    """The calibration's contention (a learner step beside one generating engine, 1 thread each on 2 cores):
    async and pipeline with one engine pay it as measured; pipeline with two engines (3 busy threads on 2
    cores) pays 1.5x that on top; sync runs one phase at a time and pays none."""
    assert contention_factor(1.4, 2, 2, 1) == pytest.approx(1.4)
    assert contention_factor(1.4, 3, 2, 1) == pytest.approx(1.4 * 1.5)
    assert contention_factor(1.4, 4, 8, 2) == pytest.approx(1.4)  # idle cores left: as measured
    plain = _profile()  # no contention measured: the fair share alone
    busy = _profile(contention={"learner": 1.6, "generation": 1.2, "threads": 1})
    train = {}
    for extra in (["trainer.mode=pipeline"], ["trainer.mode=async"], ["trainer.mode=pipeline", "rollout.num_workers=2"]):
        alone = predict_local(_cfg(*extra), lambda s: MeasuredSpeeds(plain, s))[0].phases
        beside = predict_local(_cfg(*extra), lambda s: MeasuredSpeeds(busy, s))[0].phases
        assert beside["training"] == pytest.approx(alone["training"] * 1.6)
        body = lambda ph: ph["generation"] - ph["generation_tail"]  # noqa: E731
        assert body(beside) == pytest.approx(body(alone) * 1.2)
        train[tuple(extra)] = beside["training"]
    pipeline = ("trainer.mode=pipeline",)  # two engines and a rank at one thread each on two cores: 3/2 on top
    assert train[(*pipeline, "rollout.num_workers=2")] == pytest.approx(train[pipeline] * 1.5)
    sync_alone = predict_local(_cfg(), lambda s: MeasuredSpeeds(plain, s))[0]
    assert predict_local(_cfg(), lambda s: MeasuredSpeeds(busy, s))[0].step_s == pytest.approx(sync_alone.step_s)
