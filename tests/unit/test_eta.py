"""The ETA of the progress line (issue 37): recent step time, start-up and evaluations left out."""
from __future__ import annotations

import random

import pytest

from cluster.run.eta import MIN_STEPS, EtaEstimator, format_duration


def simulate(total=50, startup_s=60.0, eval_s=30.0, eval_every=10, seed=0):
    """A run's timeline: start-up, the evaluation before training, steps of about 1 s (one slow
    checkpoint step), an evaluation every `eval_every` steps and at the end. Yields (step, estimate, truth)."""
    rng = random.Random(seed)
    eta = EtaEstimator(total, eval_every=eval_every, evaluates=True)
    now = startup_s + eval_s
    eta.eval_done(eval_s)  # the evaluation before training
    ends, estimates = {}, {}
    for step in range(1, total + 1):
        step_s = rng.uniform(0.9, 1.1) + (5.0 if step == 25 else 0.0)  # a checkpoint's save at step 25
        now += step_s
        eta.step_done(step, now, step_s)
        ends[step] = now
        estimates[step] = eta.remaining_s(step)
        if step % eval_every == 0 and step < total:
            now += eval_s
            eta.eval_done(eval_s)
    finish = now + eval_s  # the final evaluation
    return [(s, estimates[s], finish - ends[s]) for s in range(1, total + 1)]


def test_no_eta_before_a_few_steps_then_within_a_few_percent_of_the_truth():
    for step, estimate, truth in simulate():
        if step < MIN_STEPS:
            assert estimate is None, f"step {step}: an ETA from {step} step(s) is noise"
            continue
        assert estimate is not None
        # the last steps: a second's noise is more than a few % of a few seconds
        assert estimate == pytest.approx(truth, rel=0.06, abs=1.5), (step, estimate, truth)


def test_the_old_estimate_was_far_off_where_the_new_one_is_not():
    """What the progress line used to say: wall time since the logger started / steps done x steps left."""
    step, estimate, truth = simulate()[3]  # step 4
    old = (60 + 30 + 4 + 0.0) / 4 * (50 - 4)  # start-up and the first evaluation spread over 4 steps
    assert old > 5 * truth and estimate == pytest.approx(truth, rel=0.06)


def test_evaluations_left_counts_the_one_after_this_step_and_the_final_one():
    eta = EtaEstimator(50, eval_every=10, evaluates=True)
    assert eta.evaluations_left(10) == 5  # at 10 (about to run), 20, 30, 40 and the final one
    assert eta.evaluations_left(11) == 4 and eta.evaluations_left(50) == 1
    assert EtaEstimator(50, eval_every=0, evaluates=True).evaluations_left(3) == 1
    assert EtaEstimator(50, eval_every=10, evaluates=False).evaluations_left(3) == 0


def test_a_run_without_evaluations_and_a_step_without_a_time():
    eta = EtaEstimator(10)
    for step in range(1, 4):
        eta.step_done(step, 100.0 + 2 * step, 2.0)
    eta.step_done(4, 108.0, float("nan"))  # the interval still counts
    assert eta.remaining_s(4) == pytest.approx(12.0)
    assert [format_duration(s) for s in (45, 738, 7560)] == ["45s", "12.3m", "2.1h"]
