"""trainer.mode=pipeline through the real driver loop (real Ray, vLLM, DeepSpeed, tiny model): one short
run, every check on it, then a resume of it. The engine's side (an update mid-request, log-probs, no stale
prefix) is tests/e2e/test_pipeline_engine.py.
"""
from __future__ import annotations

import json
import math
import re

from cluster.driver.trainer import Trainer
from cluster.run.completions import COMPLETIONS_FILE
from learner import checkpoint
from tests.e2e.test_train import config, kill_while_learning, train_rows


def test_pipeline_run_bounds_staleness_records_versions_replaces_a_killed_engine_and_resumes(
        ray_cluster, tiny_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    # twice the default bound: a batch is always still in flight when the engines stop, so the last checkpoint
    # has prompts to record however the stop falls
    args = ["trainer.mode=pipeline", "trainer.max_staleness=1", "trainer.pipeline_groups_in_flight=8",
            "rollout.max_model_len=64", "rollout.max_new_tokens=24",
            "algo.beta=0.05", "metrics.completions_per_step=4", "rollout.max_restarts=1", "checkpoint.every=1",
            "trainer.actor_timeout_s=600"]  # engine starts took 220 s at load 50
    trainer = Trainer(config(tiny_model_dir, run, *args, "trainer.steps=3"))
    killed = kill_while_learning(trainer, at_step=1, role="rollout-0")
    out = trainer.run()
    assert killed and out["rollout_restarts"] >= 1  # the engine died mid-run and was replaced
    said = capsys.readouterr().out
    # every checkpoint records the prompts in flight: while the engines run (steps 1, 2), after they stopped (3)
    noted = {int(s): int(n) for s, n in re.findall(r"the checkpoint of step (\d) records the prompts of the (\d+) group", said)}
    in_flight = checkpoint.load_driver_state(out["checkpoint"])["data"]["in_flight"]
    assert set(noted) == {1, 2, 3} and noted[3] == len(in_flight) > 0, said[-3000:]
    assert f"pipeline: {len(in_flight)} group(s) in flight when the engines stopped were not trained on" in said

    resumed = Trainer(config(tiny_model_dir, run, *args, "trainer.steps=4"))  # checkpoint.resume=auto
    take, asked = resumed.stream.take, []

    def take_and_note(n):
        out = take(n)
        asked.extend(out)
        return out

    resumed.stream.take = take_and_note
    resumed.run()
    said = capsys.readouterr().out
    assert f"step-00000003 at step 3; the {len(in_flight)} group(s) in flight at that checkpoint are generated " \
           "again first" in said, said[-3000:]
    # the resumed run asks first for the prompts the stopped one had in flight, in the order it took them
    assert asked[:len(in_flight)] == [resumed.stream.examples[i] for i in in_flight]

    written = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in written if r["kind"] == "train"] == [1, 2, 3, 4]  # each step logged once
    rows = train_rows(run)
    assert [r["pipeline/regenerated_on_resume"] for r in rows] == [0, 0, 0, len(in_flight)]
    for r in rows:
        assert r["sync_verified"] is True
        assert 0 <= r["staleness/token_max"] <= 1, r  # trainer.max_staleness bounds every trained token
        assert 0 <= r["staleness/token_mean"] <= r["staleness/token_max"]
        assert r["versions_per_sequence_mean"] >= 1 and r["stale_groups"] >= 0
        assert 0 < r["pipeline/engine_busy_frac"] <= 1 and r["pipeline/engine_tokens_per_s"] > 0
        assert r["trained_groups"] == 4 and math.isfinite(r["loss"]) and math.isfinite(r["kl"])
    assert any(r["staleness/token_max"] == 1 for r in rows[1:])  # the engines ran ahead of the learner
    logged = [json.loads(line) for line in (run / COMPLETIONS_FILE).read_text().splitlines()]
    assert logged and all(len(row["versions"]) == row["num_tokens"] for row in logged)
    assert len({v for row in logged for v in row["versions"]}) >= 2  # trained on tokens of several versions
