"""trainer.mode=pipeline through the real driver loop (real Ray, vLLM, DeepSpeed, tiny model): one short
run, every check on it. The engine's side (an update mid-request, log-probs, no stale prefix) is
tests/e2e/test_pipeline_engine.py.
"""
from __future__ import annotations

import json
import math

from cluster.driver.trainer import Trainer
from cluster.run.completions import COMPLETIONS_FILE
from tests.e2e.test_train import config, kill_while_learning, train_rows


def test_pipeline_run_bounds_staleness_records_versions_and_replaces_a_killed_engine(ray_cluster, tiny_model_dir,
                                                                                    tmp_path):
    cfg = config(tiny_model_dir, tmp_path / "run", "trainer.mode=pipeline", "trainer.steps=4", "trainer.max_staleness=1",
                 "rollout.max_model_len=64", "rollout.max_new_tokens=24", "algo.beta=0.05",
                 "metrics.completions_per_step=4", "rollout.max_restarts=1",
                 "trainer.actor_timeout_s=600")  # engine starts took 220 s at load 50
    trainer = Trainer(cfg)
    killed = kill_while_learning(trainer, at_step=1, role="rollout-0")
    out = trainer.run()
    assert killed and out["rollout_restarts"] >= 1  # the engine died mid-run and was replaced
    rows = train_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["sync_verified"] is True
        assert 0 <= r["staleness/token_max"] <= 1, r  # trainer.max_staleness bounds every trained token
        assert 0 <= r["staleness/token_mean"] <= r["staleness/token_max"]
        assert r["versions_per_sequence_mean"] >= 1 and r["stale_groups"] >= 0
        assert 0 < r["pipeline/engine_busy_frac"] <= 1 and r["pipeline/engine_tokens_per_s"] > 0
        assert r["trained_groups"] == 4 and math.isfinite(r["loss"]) and math.isfinite(r["kl"])
    assert any(r["staleness/token_max"] == 1 for r in rows[1:])  # the engines ran ahead of the learner
    logged = [json.loads(line) for line in (tmp_path / "run" / COMPLETIONS_FILE).read_text().splitlines()]
    assert logged and all(len(row["versions"]) == row["num_tokens"] for row in logged)
    assert len({v for row in logged for v in row["versions"]}) >= 2  # trained on tokens of several versions
