"""trainer.mode=sync: each step's batch is collected with the weights the learner just sent, then trained on."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from cluster.driver.schedules.collecting import CollectingSchedule

if TYPE_CHECKING:
    from cluster.driver.batch import Batch


class SyncSchedule(CollectingSchedule):
    def next_batch(self, step: int) -> tuple[Batch, dict]:
        return self._take(step), {}

    def failure_position(self, trained_now: bool) -> Callable[[], dict]:
        # the step trained is recorded: the data position after its own batch (nothing else was collected since)
        return self.stream.state if trained_now else super().failure_position(trained_now)
