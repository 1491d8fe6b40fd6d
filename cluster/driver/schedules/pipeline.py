"""trainer.mode=pipeline: engines that never stop; the feeder (cluster/driver/pipeline.py `PipelineFeeder`)
keeps them supplied, scores each group as it arrives, and a batch is the next prompts_per_step groups within
trainer.max_staleness, in arrival order. The data position moves in the feeder's thread, ahead of training:
a checkpoint records the feeder's, with the prompts it has in flight."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from cluster.driver.pipeline import PipelineFeeder
from cluster.driver.schedules.base import CheckpointParts, Schedule

if TYPE_CHECKING:
    from cluster.driver.batch import Batch
    from cluster.driver.collector import Collector
    from cluster.driver.context import RunContext


class PipelineSchedule(Schedule):
    def __init__(self, ctx: RunContext, collector: Collector):
        """`collector`: not used (the feeder generates and scores by itself)."""
        self.cfg, self.stream = ctx.cfg, ctx.stream
        self.feeder: PipelineFeeder | None = PipelineFeeder(
            ctx.cfg, ctx.stream, ctx.scorer, ctx.pool, reference=ctx.reference, eos_id=ctx.eos_id,
            versions=ctx.versions)
        self.position_after_feeder: dict | None = None  # the feeder's position when it stopped, with its in-flight prompts
        self.regenerated = 0  # groups in flight at the checkpoint resumed from, generated again (the first row says)

    def start(self, resumed: Batch | None, regenerated: int) -> None:
        """`resumed`: not used (a pipeline checkpoint records prompts in flight, never a batch)."""
        self.regenerated = regenerated
        self.feeder.start()  # the engines run from here to the end of training

    def next_batch(self, step: int) -> tuple[Batch, dict]:
        batch, extra = self.feeder.next_batch(self.cfg.trainer.actor_timeout_s)
        extra["pipeline/regenerated_on_resume"], self.regenerated = self.regenerated, 0
        return batch, extra

    def after_update(self, version: int) -> None:
        pass  # the update landed in the running engines; the feeder measures staleness against ctx.versions

    def _position(self) -> dict:
        """The feeder's position with the prompts it has in flight (or, once it stopped, the one it stopped at)."""
        if self.feeder is not None:
            return self.feeder.checkpoint_state()
        return self.position_after_feeder or self.stream.state()

    def checkpoint_parts(self) -> CheckpointParts:
        return CheckpointParts(self._position)

    def failure_position(self, trained_now: bool) -> Callable[[], dict]:
        return self._position

    def stop(self, wait_s: float | None = None, recorded: bool = False) -> None:
        """Stop the engines' loops (`wait_s`: PipelineFeeder.stop); the groups still in flight are said, and the
        data position with their prompts kept for the final checkpoint. `recorded`: a checkpoint records those
        prompts (the final one, saved next; a stop signal's, just saved); else the line claims no checkpoint
        (issue 59: it promised one on a failure that saved none)."""
        if self.feeder is None:
            return
        feeder, self.feeder = self.feeder, None
        feeder.stop(wait_s)
        self.position_after_feeder = feeder.checkpoint_state()
        lost = len(self.position_after_feeder.get("in_flight", []))
        if lost:
            print(f"pipeline: {lost} group(s) in flight when the engines stopped were not trained on " + (
                  "(a checkpoint records their prompts: a run resumed from it generates them again first)" if recorded
                  else "and no checkpoint records them (a rerun resumes from the last checkpoint saved, if any, "
                  "with what was in flight then)"), flush=True)

    def settle(self) -> None:
        pass  # stop joined the feeder's threads and stopped every engine's loop
