"""Throughput as users read it (issue 37): perf/* metrics, and the progress line that shows them with
the ETA and the evaluations named as such."""
from __future__ import annotations

import math

import pytest

from cluster.run.metrics import MFU_KEY, PERF_KEYS, STEP_KEYS, MetricsLogger, perf_metrics, read_metrics


def test_tokens_per_second_idle_share_and_mfu():
    m = perf_metrics(gen_tokens=800, gen_s=2.0, step_s=8.0, train_tokens=1000, train_s=5.0,
                     params=1_000_000, passes=2, peak_tflops=1.0, devices=2)
    assert m["perf/tokens_per_s"] == 400 and m["perf/train_tokens_per_s"] == 200
    assert m["perf/engine_idle_frac"] == 0.75  # the engines generated 2 s of an 8 s step
    assert m[MFU_KEY] == pytest.approx(6 * 1e6 * 1000 * 2 / 5.0 / (1e12 * 2))
    # without a peak (metrics.peak_tflops=0) or a parameter count: no perf/mfu at all
    assert MFU_KEY not in perf_metrics(800, 2.0, 8.0, 1000, 5.0, params=10, peak_tflops=0.0)
    assert MFU_KEY not in perf_metrics(800, 2.0, 8.0, 1000, 5.0, params=None, peak_tflops=989.0)
    # nothing trained (dynamic sampling found no signal): NaN, not a division by zero
    skipped = perf_metrics(800, 2.0, 8.0, 0, 0.0)
    assert math.isnan(skipped["perf/train_tokens_per_s"]) and set(PERF_KEYS) <= set(STEP_KEYS)
    # async: generation overlapping training can take longer than the step's wall time
    assert perf_metrics(800, 10.0, 8.0, 1000, 5.0)["perf/engine_idle_frac"] == 0.0


def test_the_progress_line_shows_generation_speed_an_eta_after_three_steps_and_named_evaluations(tmp_path, capsys):
    log = MetricsLogger(tmp_path, 20, tensorboard=False, eval_every=10, evaluates=True)
    log.log_eval(0, {"accuracy": 0.25, "num_prompts": 8, "eval_s": 3.0})
    for step in range(1, 5):
        log.log_step({"step": step, "reward": 0.5, "reward_mean": 0.5, "step_s": 1.0, "loss": 0.1,
                      "perf/tokens_per_s": 1234.4, "completions/mean_length": 4.0, "completions/clipped_ratio": 0.0})
    log.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "eval @ step 0 (3.0s): accuracy 0.250  num_prompts 8"
    steps = [line for line in lines if line.startswith("step ")]
    assert all("gen 1234 tok/s" in line for line in steps)
    assert ["eta" in line for line in steps] == [False, False, True, True]  # from the third step on
    [eval_row] = read_metrics(tmp_path, "eval")
    assert eval_row["eval_s"] == 3.0
    assert all(r["reward"] == r["reward_mean"] == 0.5 for r in read_metrics(tmp_path))  # TRL's name beside ours
