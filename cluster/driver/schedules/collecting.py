"""What the sync and async schedules share: a batch is collected whole by the `Collector` (generation,
rewards and, with a reference actor, its log-probs; cluster/driver/collector.py) in a background thread,
and a batch made more than trainer.max_staleness versions ago is generated again before it is trained on."""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from cluster.driver.schedules.base import CheckpointParts, Schedule

if TYPE_CHECKING:
    from cluster.driver.batch import Batch
    from cluster.driver.collector import Collector
    from cluster.driver.context import RunContext


class CollectingSchedule(Schedule):
    """The collecting thread, the batch being collected (`pending`) and the data position before it."""

    def __init__(self, ctx: RunContext, collector: Collector):
        self.cfg, self.collector, self.stream, self.versions = ctx.cfg, collector, ctx.stream, ctx.versions
        self.learners = ctx.learners  # async lends the collecting side's idle cores to its next train call
        self._collecting = ThreadPoolExecutor(1, thread_name_prefix="collect")
        self.pending: Future | None = None  # the batch being collected (or collected) for the next step
        self.position_before_pending: dict = {}  # the data position before that batch's prompts

    def start(self, resumed: Batch | None, regenerated: int) -> None:
        if resumed is not None:  # generated before the checkpoint was taken: trained on first
            self.pending, self.position_before_pending = Future(), resumed.stream_state
            self.pending.set_result(resumed)

    def _take(self, step: int) -> Batch:
        """The batch for `step`: the one collected ahead (or resumed), else collected now; collected again if it is
        more than trainer.max_staleness versions behind the learner."""
        batch = (self.pending or self._collect(step)).result()
        self.pending = None
        if self.versions.learner - batch.weight_version > self.cfg.trainer.max_staleness:
            return self._collect(step).result()  # with the weights now
        return batch

    def _collect(self, step: int, lend_to: int | None = None) -> Future:
        """Steps 1-3 in the collecting thread (`lend_to`: see Collector.collect)."""
        self.position_before_pending = self.stream.state()  # the collecting thread is idle whenever this is called
        return self._collecting.submit(self.collector.collect, step, lend_to)

    def after_update(self, version: int) -> None:
        pass  # the next batch is collected (sync) or already under way (async) when next_batch asks for it

    def checkpoint_parts(self) -> CheckpointParts:
        return CheckpointParts(self.stream.state, self.pending, self.position_before_pending)

    def failure_position(self, trained_now: bool) -> Callable[[], dict]:
        return lambda: self.position_before_pending  # before the batch being collected

    def stop(self, wait_s: float | None = None, recorded: bool = False) -> None:
        self._collecting.shutdown(wait=False, cancel_futures=True)  # a collection under way ends on its own

    def settle(self) -> None:
        self._collecting.shutdown(wait=True, cancel_futures=True)
