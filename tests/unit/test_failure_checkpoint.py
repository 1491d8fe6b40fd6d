"""Issue 59, item 2: a run that stops on a failure while its learner lives (an engine dead past rollout.max_restarts or
hung past trainer.actor_timeout_s) saves a checkpoint of its trained steps first and says what to rerun. The trainer's
driver side with fakes (tests/unit/test_collect.py checkpointing_trainer): no Ray, learners that write a marker."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from cluster.driver.worker_groups import Stopwatch
from cluster.launch.waits import ActorFailed
from cluster.run.metrics import MetricsLogger
from cluster.run.resume import resume_point
from cluster.run.stopping import StopSignals
from learner import checkpoint
from tests.unit.test_collect import checkpointing_trainer


def engine_past_its_budget() -> ActorFailed:
    return ActorFailed("rollout worker 1", "restarting after a crash", died=True,
                       detail="it died for good: Ray restarted it 0 time(s), its whole restart budget")


def runnable(t, fail_at_step: int, error: BaseException):
    """`t` whose run() trains (fakes) to `fail_at_step` steps and then fails with `error` while collecting."""
    t.overwrite, t.stop, t.heldout, t.run_dir = False, StopSignals(25.0), [], Path(t.cfg.trainer.run_dir)
    t.learner_restarts = 0
    t.scorer.close = lambda: None
    t._open_log = t._setup = lambda: None
    t._teardown = lambda: None

    def train():
        t.step, t.schedule.position_before_pending = fail_at_step, {"pos": 2 * fail_at_step}
        raise error

    t._train = train
    return t


def test_an_engine_past_its_budget_stops_the_run_with_a_checkpoint_of_its_last_step(tmp_path, capsys):
    """Before: with the default checkpoint.every the run stopped with no checkpoint (7, 9, 10 and 11 steps lost in
    four runs). Now the run still stops on the engine's error, after saving step 8's checkpoint."""
    t, _ = checkpointing_trainer(tmp_path, [[1, 0]] * 8)
    runnable(t, 8, engine_past_its_budget())
    with pytest.raises(ActorFailed, match="rollout worker 1"):
        t.run()
    state = checkpoint.load_driver_state(tmp_path / "checkpoints" / checkpoint.step_dir_name(8))
    assert state["step"] == 8 and state["data"] == {"pos": 16}  # the data position before the batch collecting
    said = capsys.readouterr().out
    assert "the checkpoint of step 8 was saved first" in said and "run the same command again to resume" in said
    assert resume_point(t.cfg).step == 8  # the same command resumes there
    assert t.failure_checkpoint is not None  # pipeline mode's line on the groups in flight then says a checkpoint holds them


def test_a_step_trained_whose_weight_update_failed_is_logged_and_saved_as_trained(tmp_path):
    """The engine died during the weight update after the learner's optimizer step: that step is the learner's
    state, so its row is logged and the checkpoint is of it (a resume neither skips nor repeats a step)."""
    t, _ = checkpointing_trainer(tmp_path, [[1, 0]] * 8)
    t.step, t.version = 4, 5
    t.log = MetricsLogger(tmp_path, 10, tensorboard=False, extra_keys=[f"rewards/f/{k}" for k in
                                                                      ("mean", "std", "errors", "unscorable", "s")])
    batch = t.collector.collect(step=4)
    sw = Stopwatch()
    sw.t["train_s"] = 0.5
    t._unrecorded = (batch, {"loss": 0.25}, sw, 0.0)
    t._save_before_failing(engine_past_its_budget())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("kind") == "train"] == [5] and rows[-1]["loss"] == 0.25
    assert checkpoint.load_driver_state(tmp_path / "checkpoints" / checkpoint.step_dir_name(5))["step"] == 5
    assert t.step == 5 and t.saved_step == 5 and t._unrecorded is None


def test_nothing_new_since_the_last_checkpoint_is_not_saved_again_and_a_failed_save_is_said(tmp_path, capsys):
    t, _ = checkpointing_trainer(tmp_path, [[1, 0]] * 8)
    t.step, t.saved_step = 3, 3
    t._save_before_failing(engine_past_its_budget())
    assert not (tmp_path / "checkpoints").exists()
    t.step = 4
    t.ctx = dataclasses.replace(t.ctx, learners=SimpleNamespace(
        save=lambda d, tag: (_ for _ in ()).throw(TimeoutError("learner rank 0: no answer"))))
    t._save_before_failing(engine_past_its_budget())
    assert "saving a checkpoint of step 4 first failed too (TimeoutError: learner rank 0: no answer)" in \
        capsys.readouterr().out


def test_a_dead_learner_is_not_asked_for_a_checkpoint(tmp_path):
    t, _ = checkpointing_trainer(tmp_path, [[1, 0]] * 8)
    t.cfg.trainer.max_learner_restarts = 0
    runnable(t, 6, ActorFailed("learner rank 0", "training", died=True, detail="killed"))
    asked = []
    t.ctx = dataclasses.replace(t.ctx, learners=SimpleNamespace(save=lambda d, tag: asked.append(d)))
    with pytest.raises(ActorFailed, match="learner rank 0"):
        t.run()
    assert not asked


def test_a_pipeline_waits_timeout_saves_too(tmp_path):
    """Item 4's message and item 2's checkpoint: the pipeline's TimeoutError (no group in time) is a failure whose
    learner lives."""
    t, _ = checkpointing_trainer(tmp_path, [[1, 0]] * 8)
    runnable(t, 2, TimeoutError("pipeline: 0 of 4 groups in 60s"))
    with pytest.raises(TimeoutError):
        t.run()
    assert checkpoint.load_driver_state(tmp_path / "checkpoints" / checkpoint.step_dir_name(2))["step"] == 2
