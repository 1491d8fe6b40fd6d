"""trainer.mode=pipeline through the real driver loop (real Ray, vLLM, DeepSpeed, tiny model): one short
run, every check on it, its engine killed and its learner rank killed, which resumes it from a checkpoint in
the same run. The engine's side (an update mid-request, log-probs, no stale prefix) is
tests/e2e/test_pipeline_engine.py.
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
    """The engine is SIGKILLed while step 2 trains: replaced, the run goes on. The learner rank is SIGKILLed while
    it trains step 4: the ranks restart and the run resumes from the step-3 checkpoint, whose prompts in flight
    (taken by the feeder, not trained on) are asked for first and generated again, said and counted. The final
    checkpoint, taken after the engines stopped, records the prompts still in flight then. (Formerly the resume
    was a second run from the final checkpoint, an engine start more; a resume from the final checkpoint, in a new
    trainer, is tests/unit/test_pipeline.py's
    test_the_final_checkpoint_records_what_was_in_flight_when_the_engines_stopped_and_a_resume_says_it.)"""
    run = tmp_path / "run"
    # twice the default bound: a batch is always still in flight when the engines stop, so the last checkpoint
    # has prompts to record however the stop falls
    args = ["trainer.mode=pipeline", "trainer.max_staleness=1", "trainer.pipeline_groups_in_flight=8",
            "rollout.max_model_len=64", "rollout.max_new_tokens=24",
            "algo.beta=0.05", "metrics.completions_per_step=4", "rollout.max_restarts=1", "checkpoint.every=1",
            "checkpoint.keep=4", "trainer.max_learner_restarts=1",
            "trainer.actor_timeout_s=600"]  # engine starts took 220 s at load 50
    trainer = Trainer(config(tiny_model_dir, run, *args, "trainer.steps=4"))
    killed = kill_while_learning(trainer, at_step=1, role="rollout-0")
    killed_rank = kill_while_learning(trainer, at_step=3, role="learner-0")  # training step 4
    take, asked, resumed_at = trainer.stream.take, [], []

    def take_and_note(n):
        out = take(n)
        asked.extend(out)
        return out

    trainer.stream.take = take_and_note
    resume = trainer._resume

    def note_and_resume(*a, **kw):  # the run's start, then the learner restart's resume
        resumed_at.append(len(asked))
        return resume(*a, **kw)

    trainer._resume = note_and_resume
    out = trainer.run()
    assert killed and out["rollout_restarts"] >= 1  # the engine died mid-run and was replaced
    assert killed_rank and trainer.learner_restarts == 1 and len(resumed_at) == 2
    said = capsys.readouterr().out
    # every checkpoint records the prompts in flight: while the engines run (steps 1-3), after they stopped (4)
    noted = {int(s): int(n) for s, n in re.findall(r"the checkpoint of step (\d) records the prompts of the (\d+) group", said)}
    step3 = run / "checkpoints" / checkpoint.step_dir_name(3)
    resumed_in_flight = checkpoint.load_driver_state(step3)["data"]["in_flight"]
    final_in_flight = checkpoint.load_driver_state(out["checkpoint"])["data"]["in_flight"]
    assert set(noted) == {1, 2, 3, 4} and noted[3] == len(resumed_in_flight) > 0, said[-3000:]
    assert noted[4] == len(final_in_flight) > 0, said[-3000:]
    assert f"pipeline: {len(final_in_flight)} group(s) in flight when the engines stopped were not trained on" in said
    assert f"step-00000003 at step 3; the {len(resumed_in_flight)} group(s) in flight at that checkpoint are generated " \
           "again first" in said, said[-3000:]
    # the resumed run asks first for the prompts the stopped one had in flight, in the order it took them
    again = asked[resumed_at[-1]:]
    assert again[:len(resumed_in_flight)] == [trainer.stream.examples[i] for i in resumed_in_flight]

    written = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in written if r["kind"] == "train"] == [1, 2, 3, 4]  # each step logged once
    rows = train_rows(run)
    assert [r["pipeline/regenerated_on_resume"] for r in rows] == [0, 0, 0, len(resumed_in_flight)]
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
