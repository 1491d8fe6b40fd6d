"""The schedule seam (cluster/driver/schedules/): the driver loop asks its schedule for batches and branches on
no trainer.mode, so a new schedule is one module and one line of SCHEDULES. A toy fourth schedule is added
here that way and the real `Trainer._train` runs with it over test_collect.py's fakes (no Ray, no engines);
then what each shipped schedule does at the seam."""
from __future__ import annotations

import inspect
import re
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from actors.rewards.scorer import REWARD_STATS
from cluster.driver.schedules import SCHEDULES, CheckpointParts, Schedule
from cluster.driver.schedules.pipeline import PipelineSchedule
from cluster.driver.trainer import Trainer
from cluster.run.health import HealthMonitor
from cluster.run.metrics import MetricsLogger, read_metrics
from learner import checkpoint
from tests.unit.test_collect import checkpointing_trainer, trainer


class CollectOnUpdate(Schedule):
    """The toy schedule, a module of its own as a new schedule is: each batch is collected as soon as the weights
    it is trained with have landed on the engines (after_update), not when the loop asks for it."""

    def __init__(self, ctx, collector):
        self.cfg, self.collector, self.stream, self.versions = ctx.cfg, collector, ctx.stream, ctx.versions
        self.ready, self.made_with, self.updates, self.stopped = None, [], [], []

    def _collect(self, step: int) -> None:
        self.made_with.append(self.versions.sent)  # the weights every engine holds: what the batch is made with
        self.ready = self.collector.collect(step)

    def start(self, resumed, regenerated):
        self._collect(0)

    def next_batch(self, step):
        batch, self.ready = self.ready, None
        return batch, {}

    def after_update(self, version):
        self.updates.append(version)
        if len(self.updates) < self.cfg.trainer.steps:
            self._collect(len(self.updates))

    def checkpoint_parts(self):
        return CheckpointParts(self.stream.state)

    def failure_position(self, trained_now):
        return self.stream.state

    def stop(self, wait_s=None, recorded=False):
        self.stopped.append(recorded)

    def settle(self):
        pass


def looping(tmp_path, mode: str, steps: int = 3):
    """The real loop (Trainer._train) over the collecting fakes; the learners record what they train on."""
    t, _ = checkpointing_trainer(tmp_path, [[1, 0], [0, 1]] * (steps + 1), mode=mode)
    trained = []
    t.ctx.learners.train = lambda batch: trained.append(batch) or {"tokens": 1}
    t.ctx.learners.export_hf = lambda out_dir: None
    t.cfg.trainer.steps, t.cfg.trainer.prompts_per_step, t.cfg.checkpoint.every = steps, 2, 2
    t.run_dir, t.heldout, t.resumed_batch, t.regenerated_on_resume, t.pad_id = tmp_path, None, None, 0, 0
    t.stop = SimpleNamespace(armed=False, requested=False)
    t.health = HealthMonitor(t.cfg.trainer, beta=0.0, mismatch_expected=False, run_dir=str(tmp_path))
    t.log = MetricsLogger(tmp_path, steps, tensorboard=False, extra_keys=tuple(f"rewards/f/{k}" for k in REWARD_STATS))
    t.scorer.restarts, t._teardown = 0, lambda: None
    return t, trained


def test_a_new_schedule_is_one_module_and_one_line_and_the_loop_runs_it(tmp_path, monkeypatch):
    monkeypatch.setitem(SCHEDULES, "collect_on_update", CollectOnUpdate)  # the one line
    t, trained = looping(tmp_path, "collect_on_update")
    assert isinstance(t.schedule, CollectOnUpdate)
    out = t._train()
    toy = t.schedule
    assert len(trained) == 3 and [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert toy.updates == [6, 7, 8]  # told each update's version (the fakes' learner starts at version 5)
    assert toy.made_with == [5, 6, 7]  # each batch collected from the weights of the update just before it
    assert toy.stopped == [True]  # stopped once, before the final checkpoint, which records what was in flight
    # checkpoint 2 records the schedule's data position: past batch 3's prompts, collected when update 2 landed
    assert checkpoint.load_driver_state(tmp_path / "checkpoints" / checkpoint.step_dir_name(2))["data"] == {"pos": 6}
    assert Path(out["checkpoint"]).name == checkpoint.step_dir_name(3)


def test_the_loop_branches_on_no_schedule():
    """Issue 60: Trainer._train branched on the mode or the feeder 9 times; the schedule decides now."""
    src = inspect.getsource(Trainer._train)
    assert not re.search(r"\bmode\b|feeder|pipeline|async|isinstance|pending", src), src
    assert set(SCHEDULES) >= {"sync", "async", "pipeline"}  # trainer.mode's values, unchanged


def collected(t) -> list:
    """Spy on the collector: (step, lend_to) of each collection the schedule starts."""
    calls, collect = [], t.collector.collect
    t.collector.collect = lambda step, lend_to=None: calls.append((step, lend_to)) or collect(step, lend_to)
    return calls


def test_sync_collects_each_batch_when_asked_and_records_the_position_after_a_trained_step():
    t = trainer([[1, 0]] * 8, want=2, mode="sync")
    calls = collected(t)
    batch, extra = t.schedule.next_batch(0)
    assert calls == [(0, None)] and t.schedule.pending is None and extra == {} and len(batch.examples) == 2
    assert t.schedule.checkpoint_parts().pending is None
    assert t.schedule.failure_position(trained_now=True)() == {"pos": 2}  # after the step's own batch
    assert t.schedule.failure_position(trained_now=False)() == {"pos": 0}  # before the batch being collected


def test_async_collects_the_next_batch_while_the_step_trains_and_a_checkpoint_carries_it():
    t = trainer([[1, 0]] * 8, want=2, mode="async")
    t.cfg.trainer.steps = 2
    t.schedule.learners = SimpleNamespace(train_calls=7)  # the learner group's count of train calls made
    calls = collected(t)
    t.schedule.next_batch(0)
    parts = t.schedule.checkpoint_parts()
    assert parts.pending is t.schedule.pending and parts.pending.result().examples[0].prompt == "p2"
    assert calls == [(0, None), (1, 7)]  # step 1 collected ahead, lending its idle cores to train call 7
    assert parts.before_pending == {"pos": 2} and t.schedule.failure_position(trained_now=True)() == {"pos": 2}
    t.schedule.next_batch(1)  # the last step: nothing collected ahead
    assert calls == [(0, None), (1, 7)] and t.schedule.pending is None


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_resumed_batch_is_trained_first(mode):
    t = trainer([[1, 0]] * 8, want=2, mode=mode)
    t.cfg.trainer.steps = 1
    resumed = t.collector.collect(3)
    t.schedule.start(resumed, regenerated=0)
    assert t.schedule.next_batch(0)[0] is resumed


def test_the_pipeline_says_its_regenerated_groups_once_and_checkpoints_the_feeders_position(tmp_path):
    t, _ = checkpointing_trainer(tmp_path, [[1, 0]] * 8, mode="pipeline")
    s: PipelineSchedule = t.schedule
    asked = []
    s.feeder = SimpleNamespace(start=lambda: asked.append("start"), checkpoint_state=lambda: {"in_flight": [3]},
                               next_batch=lambda timeout_s: (asked.append(timeout_s), {"stale_groups": 0}))
    s.start(resumed=None, regenerated=2)
    assert asked == ["start"]
    assert s.next_batch(0)[1] == {"stale_groups": 0, "pipeline/regenerated_on_resume": 2}
    assert s.next_batch(1)[1] == {"stale_groups": 0, "pipeline/regenerated_on_resume": 0}
    assert asked[1:] == [t.cfg.trainer.actor_timeout_s] * 2
    assert s.checkpoint_parts().position() == {"in_flight": [3]} and s.checkpoint_parts().pending is None
    assert s.failure_position(trained_now=True)() == {"in_flight": [3]}


def test_a_stopped_collection_under_way_is_waited_for_only_when_the_engines_are_kept():
    """stop() starts no new collection and returns at once (the run's end, after a failure); settle() waits for the
    one under way (a learner restart keeps the engines: they must be idle before the new ranks connect)."""
    t = trainer([[1, 0]] * 8, want=2, mode="async")
    release, started = threading.Event(), threading.Event()
    collect = t.collector.collect
    t.collector.collect = lambda step, lend_to=None: (started.set(), release.wait(10), collect(step, lend_to))[2]
    pending = t.schedule._collect(0)
    assert started.wait(10)
    t.schedule.stop()
    assert not pending.done()  # stop did not wait for it
    threading.Timer(0.2, release.set).start()
    t.schedule.settle()
    assert pending.done() and len(pending.result().examples) == 2
