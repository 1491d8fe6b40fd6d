"""trainer.mode=async: the batch of step k+1 is collected while the learner trains step k, so collecting
overlaps training and each batch is one weight version old (trainer.max_staleness bounds how old it may be).
A checkpoint saves the batch being collected with it (cluster/driver/checkpoints.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from cluster.driver.schedules.collecting import CollectingSchedule

if TYPE_CHECKING:
    from cluster.driver.batch import Batch


class AsyncSchedule(CollectingSchedule):
    def next_batch(self, step: int) -> tuple[Batch, dict]:
        batch = self._take(step)
        if step + 1 < self.cfg.trainer.steps:
            # Overlaps the training of `batch`, which is the learners' next train call: once this
            # batch is collected, that call may take the collecting side's cores.
            self.pending = self._collect(step + 1, lend_to=self.learners.train_calls)
        return batch, {}
