"""`raygrpo plan`'s pipeline schedule (issue 62): the engine loop's measured cost over a plain generate call
(profile.py pipeline_loop_factor, cluster/bench/calibrate_pipeline.py) and the feeder's wait when the groups
in flight are under two steps' (cost.py feeder_wait_s, from cluster/driver/pipeline_bounds.py). No actor
starts: a profile is written by hand, the rollout worker is a stand-in."""
import pytest

from cluster.bench.calibrate_pipeline import loop_busy_s, measure_pipeline_loop
from cluster.driver.pipeline_bounds import POLL_S, in_flight_bound
from cluster.plan.command import TASK_PROMPT_TOKENS
from cluster.plan.cost import Candidate, Workload, feeder_wait_s, predict
from cluster.plan.fit import predict_local
from cluster.plan.hardware import parse_cluster
from cluster.plan.profile import MeasuredSpeeds, SpecSpeeds
from cluster.plan.shapes import PUBLISHED
from tests.unit.test_plan_local import _cfg, _profile

LOOP = [{"batch": 64, "new_tokens": 16, "plain_s": 1.0, "loop_busy_s": 1.3},
        {"batch": 64, "new_tokens": 64, "plain_s": 4.0, "loop_busy_s": 4.4}]
SLOW_ENGINE = {"generation": [{"batch": 1, "tokens_per_s": 5.0}, {"batch": 64, "tokens_per_s": 80.0}]}


def test_the_loop_factor_is_linear_in_one_over_the_length_between_the_measured_lengths():
    speeds = MeasuredSpeeds(_profile(pipeline_loop=LOOP), _shape())
    assert speeds.pipeline_loop_factor(16) == pytest.approx(1.3)
    assert speeds.pipeline_loop_factor(64) == pytest.approx(1.1)
    # 32 tokens: 1/32 lies two thirds of the way from 1/16 to 1/64, so the ratio does too (not halfway, as in m)
    assert speeds.pipeline_loop_factor(32) == pytest.approx(1.3 - 0.2 * 2 / 3)
    assert speeds.pipeline_loop_factor(8) == pytest.approx(1.3) and speeds.pipeline_loop_factor(512) == pytest.approx(1.1)
    assert MeasuredSpeeds(_profile(), _shape()).pipeline_loop_factor(32) == 1.0  # unmeasured: none


def _shape():
    return PUBLISHED["SmolLM2-135M-Instruct"]


def test_the_feeder_waits_a_poll_period_a_step_with_under_two_steps_in_flight():
    """max_staleness 1 (the default): one step's groups in flight, the engine idles between its last group and
    the next top-up; two steps' (max_staleness 2, or pipeline_groups_in_flight) let it run on."""
    one = _cfg("trainer.mode=pipeline")
    assert in_flight_bound(one.trainer) == 8
    wl = predict_local(one, lambda s: MeasuredSpeeds(_profile(), s))[2]
    assert wl.in_flight_groups == 8 and feeder_wait_s(wl) == POLL_S
    for more in ("trainer.max_staleness=2", "trainer.pipeline_groups_in_flight=16"):
        assert feeder_wait_s(predict_local(_cfg("trainer.mode=pipeline", more), lambda s: MeasuredSpeeds(_profile(), s))[2]) == 0.0
    assert feeder_wait_s(predict_local(_cfg("trainer.mode=pipeline", "trainer.pipeline_groups_in_flight=12"),
                                       lambda s: MeasuredSpeeds(_profile(), s))[2]) == POLL_S


def test_an_engine_bound_pipeline_step_is_the_loop_plus_the_feeders_wait():
    """The engine side: its generation x the loop factor, the reward, the feeder's wait; then the update."""
    prof = _profile(pipeline_loop=LOOP, **SLOW_ENGINE)
    speeds_of = lambda s: MeasuredSpeeds(prof, s)  # noqa: E731
    plain = _profile(**SLOW_ENGINE)
    pipe = predict_local(_cfg("trainer.mode=pipeline"), speeds_of)[0]
    unmeasured = predict_local(_cfg("trainer.mode=pipeline"), lambda s: MeasuredSpeeds(plain, s))[0]
    factor = MeasuredSpeeds(prof, _shape()).pipeline_loop_factor(32)
    assert pipe.phases["generation"] == pytest.approx(unmeasured.phases["generation"] * factor)
    assert pipe.phases["wait_feeder"] == POLL_S
    ph = pipe.phases
    assert ph["generation"] + ph["reward"] + POLL_S > ph["training"]  # engine-bound, as meant
    assert pipe.step_s == pytest.approx(ph["generation"] + ph["reward"] + POLL_S + ph["weight_sync"] + ph["overhead"])
    assert pipe.engine_idle_fraction == pytest.approx(1 - ph["generation"] / pipe.step_s)
    two = predict_local(_cfg("trainer.mode=pipeline", "trainer.max_staleness=2"), speeds_of)[0]
    assert two.phases["wait_feeder"] == 0.0 and two.step_s == pytest.approx(pipe.step_s - POLL_S)
    for mode in ("sync", "async"):  # the loop and the feeder are the pipeline's only
        cfg = _cfg(f"trainer.mode={mode}")
        assert predict_local(cfg, speeds_of)[0].step_s == pytest.approx(
            predict_local(cfg, lambda s: MeasuredSpeeds(plain, s))[0].step_s)


def test_a_spec_has_no_loop_factor_but_the_feeder_still_polls():
    """On devices the loop's host cost is in the efficiencies; the feeder's poll period is the code's anywhere."""
    speeds = SpecSpeeds(parse_cluster("1x8xH100"), _shape())
    assert speeds.pipeline_loop_factor(1024) == 1.0
    wl = Workload(prompts=8, group=8, prompt_tokens=64, mean_new_tokens=256, max_new_tokens=512, max_model_len=1024,
                  mu=1, beta=0.0, max_staleness=1, dtype_bytes=2, gpu_memory_utilization=0.5, eager=False)
    c = Candidate(engines=1, tp=1, ranks=1, zero_stage=0, micro_batch=8, mode="pipeline")
    assert predict(_shape(), wl, c, speeds, 80e9, 8, 8).phases["wait_feeder"] == POLL_S


class _Cfg:
    min_new_tokens, max_new_tokens = 1, 96


class _Loop:
    def __init__(self, calls):
        self.calls = calls

    def pause(self):
        self.calls.append(("pause",))

    def after_update(self):
        self.calls.append(("after_update",))

    def resume(self):
        self.calls.append(("resume",))


class _Worker:
    """The rollout actor's pipeline calls, as a stand-in: a group comes back at each poll after the second,
    the tokens say half of them are out from the second poll on."""

    def __init__(self):
        self.cfg, self.calls, self.busy, self.pending, self.stopped = _Cfg(), [], 5.0, [], 0
        self.polls, self._loop = 0, _Loop(self.calls)

    def pipeline_start(self):
        self.calls.append(("start", self.cfg.min_new_tokens, self.cfg.max_new_tokens))

    def pipeline_submit(self, groups):
        self.pending += [k for k, _, _ in groups]
        self.calls.append(("submit", len(groups), groups[0][2]))

    def pipeline_take(self):
        self.polls += 1
        back = self.pending[:1] if self.polls > 3 else []  # the first take is the count before submitting
        self.pending = self.pending[len(back):]
        self.busy += 0.25 * len(back)
        self.calls.append(("take",))
        return {"rollouts": back, "stats": {"busy_s": self.busy, "tokens": 10 ** 6 if self.polls > 2 else 0}}

    def pipeline_stop(self):
        self.stopped += 1
        return []


def test_the_loop_point_counts_the_engines_busy_time_and_leaves_the_engine_as_it_was():
    w = _Worker()
    assert loop_busy_s(w, [[1, 2], [3, 4], [5, 6]], 8, 32) == pytest.approx(0.75)  # 5.0 before is not its
    assert w.calls[0] == ("start", 32, 32) and ("submit", 3, 8) in w.calls
    assert (w.cfg.min_new_tokens, w.cfg.max_new_tokens) == (1, 96) and w.stopped == 1 and not w.pending
    assert ("after_update",) not in w.calls
    w = _Worker()
    loop_busy_s(w, [[1, 2], [3, 4]], 8, 32, update_halfway=True)
    updates = [i for i, c in enumerate(w.calls) if c == ("after_update",)]
    assert len(updates) == 1 and w.calls[updates[0] - 1] == ("pause",) and w.calls[updates[0] + 1] == ("resume",)
    assert w.calls.index(("take",), 3) < updates[0]  # once half the tokens are out, not at the start


def test_the_loop_points_pair_a_plain_call_with_the_loop_at_each_length():
    w, plain = _Worker(), []

    def plain_point(worker, batch, length):
        plain.append((batch, length))
        return {"seconds": 2.0 + len(plain) % 2}  # the better of two: 2.0

    def fresh_polls(*a, **k):  # each loop point starts counting its polls anew, as a new loop would
        w.polls = 0
        return real_start()

    real_start, w.pipeline_start = w.pipeline_start, fresh_polls
    pts = measure_pipeline_loop(w, plain_point, 16, (16, 64), 8)
    assert [(p["batch"], p["new_tokens"], p["plain_s"], p["prompt_tokens"]) for p in pts] == [(16, 16, 2.0, 8), (16, 64, 2.0, 8)]
    assert plain == [(16, 16), (16, 16), (16, 64), (16, 64)]
    assert all(p["loop_busy_s"] == pytest.approx(0.5) for p in pts)  # 2 prompts of 16 / 8, 0.25 s each
    assert all(p["loop_update_busy_s"] == pytest.approx(0.5) for p in pts)
    assert w.stopped == 9 and w.calls.count(("after_update",)) == 4  # warm-up, then two plain and two updated a length


def test_an_update_landing_on_running_requests_prefills_them_again():
    """recompute (the default): measured per token of context the running requests held; paid by an engine-bound
    pipeline (the update lands while it generates), always with two steps in flight, never with keep, and not by a
    learner-bound pipeline with one step in flight (its engine idles by the time the update comes)."""
    loop = [{**p, "prompt_tokens": 8, "loop_update_busy_s": p["loop_busy_s"] + 0.01 * 64 * (8 + p["new_tokens"] / 2)}
            for p in LOOP]
    speeds = MeasuredSpeeds(_profile(pipeline_loop=loop), _shape())
    assert speeds.recompute_s(1000) == pytest.approx(10.0)
    assert MeasuredSpeeds(_profile(pipeline_loop=LOOP), _shape()).recompute_s(1000) == 0.0  # unmeasured
    slow = lambda s: MeasuredSpeeds(_profile(pipeline_loop=loop, **SLOW_ENGINE), s)  # noqa: E731
    pipe = predict_local(_cfg("trainer.mode=pipeline"), slow)[0]
    assert pipe.phases["recompute"] == pytest.approx(0.01 * 64 * (TASK_PROMPT_TOKENS + 16))
    ph = pipe.phases
    assert pipe.step_s == pytest.approx(ph["generation"] + ph["recompute"] + ph["reward"] + POLL_S + ph["weight_sync"]
                                        + ph["overhead"])
    assert predict_local(_cfg("trainer.mode=pipeline", "rollout.kv_after_update=keep"), slow)[0].phases["recompute"] == 0
    fast = lambda s: MeasuredSpeeds(_profile(pipeline_loop=loop), s)  # noqa: E731
    learner_bound = predict_local(_cfg("trainer.mode=pipeline"), fast)[0]
    assert learner_bound.phases["generation"] < learner_bound.phases["training"]
    assert learner_bound.phases["recompute"] == 0.0
    ahead = predict_local(_cfg("trainer.mode=pipeline", "trainer.max_staleness=2"), fast)[0]
    assert ahead.phases["recompute"] == pytest.approx(pipe.phases["recompute"])  # learner-bound, paid all the same
    a = ahead.phases  # here the re-prefill makes the engines the slower side, with no feeder wait
    assert ahead.step_s == pytest.approx(a["generation"] + a["recompute"] + a["reward"] + a["weight_sync"] + a["overhead"])
