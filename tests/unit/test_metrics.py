import json
import math

import pytest

from cluster.metrics import STEP_KEYS, MetricsLogger, plot_run, read_metrics


def test_every_step_line_has_the_required_keys_and_plots(tmp_path):
    log = MetricsLogger(tmp_path, total_steps=3, tensorboard=True)
    for step in (1, 2, 3):
        log.log_step({"step": step, "reward_mean": 0.1 * step, "loss": 0.5, "kl": float("nan"), "step_s": 1.0,
                      "gen_s": 0.4, "train_s": 0.3, "sync_s": 0.1})
    log.log_eval(3, {"accuracy": 0.5, "pass@4": 0.7})
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 3 and all(set(STEP_KEYS) <= set(r) for r in train)
    assert train[0]["kl"] is None  # NaN is written as null: valid JSON
    assert any((tmp_path / "tensorboard").iterdir())
    paths = plot_run(tmp_path)
    assert [p.name for p in paths] == ["reward.png", "kl.png", "step_time.png"]
    assert all(p.stat().st_size > 1000 and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_resumed_steps_replace_earlier_rows(tmp_path):
    log = MetricsLogger(tmp_path, total_steps=3, tensorboard=False)
    log.log_step({"step": 1, "reward_mean": 0.1})
    log.log_step({"step": 2, "reward_mean": 0.2})
    log.log_step({"step": 2, "reward_mean": 0.25})  # the run resumed from step 1
    log.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and math.isclose(rows[1]["reward_mean"], 0.25)


def test_an_undeclared_step_metric_is_refused(tmp_path):
    log = MetricsLogger(tmp_path, total_steps=1, tensorboard=False)
    with pytest.raises(ValueError, match="not in cluster/metrics.py STEP_KEYS"):
        log.log_step({"step": 1, "reward_meen": 0.1})
    log.close()
