"""What a training schedule is: the one seam between the driver loop and how its batches are made.

The loop (cluster/driver/trainer.py `Trainer._train`) is the same for every schedule:

    schedule.start(resumed_batch, regenerated)
    while step < trainer.steps:
        batch, extra = schedule.next_batch(step)    # the batch, with batch.weight_version, its row's extra metrics
        train on it, send the weights (version v)   # the learner's side, the same in every schedule
        schedule.after_update(v)
        checkpoint with schedule.checkpoint_parts() (or, failing, schedule.failure_position(...))
    schedule.stop(recorded=True)

A schedule is one module of this package and one line of its table (`SCHEDULES`, cluster/driver/schedules/
__init__.py), chosen by trainer.mode. Each is built with the run's context (cluster/driver/context.py) and the
collector (cluster/driver/collector.py), taking what it needs from them.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from cluster.driver.batch import Batch


@dataclass(frozen=True)
class CheckpointParts:
    """What a checkpoint records of the schedule (cluster/driver/checkpoints.py `save`)."""

    position: Callable[[], dict]  # the data position, read once `pending` is complete (pipeline: with the in-flight prompts)
    pending: Future | None = None  # the next step's batch, being collected (async): saved with the checkpoint
    before_pending: dict | None = None  # the data position before `pending`, recorded instead if it failed


class Schedule(Protocol):
    """How the batches of a run are made, and what the rest of the run needs to know of it."""

    def start(self, resumed: Batch | None, regenerated: int) -> None:
        """Training starts (again). `resumed`: the next step's batch saved with the checkpoint resumed from
        (trained on first by a schedule that collects; None: none); `regenerated`: the groups in flight at that
        checkpoint, generated again first (the pipeline reports them)."""
        ...

    def next_batch(self, step: int) -> tuple[Batch, dict]:
        """The batch the learner trains at `step` (0-based), its weights' version in `batch.weight_version`, never
        more than trainer.max_staleness versions behind the learner; and extra metrics for the step's row."""
        ...

    def after_update(self, version: int) -> None:
        """The step's update is done: the engines hold weights `version` (unchanged if the step trained nothing)."""
        ...

    def checkpoint_parts(self) -> CheckpointParts:
        """What a checkpoint of the step just trained records of the schedule."""
        ...

    def failure_position(self, trained_now: bool) -> Callable[[], dict]:
        """The data position a checkpoint saved on the way out of a failure records (it carries no pending batch).
        `trained_now`: the step whose update failed was trained and is recorded now."""
        ...

    def stop(self, wait_s: float | None = None, recorded: bool = False) -> None:
        """No more generation: what runs ends (`wait_s`: at most this for an engine to answer; None:
        trainer.actor_timeout_s), without waiting for a collection under way. `recorded`: a checkpoint records
        what was in flight (said so on the console). Safe to call again."""
        ...

    def settle(self) -> None:
        """After `stop`: wait for the generation still under way to end (a learner restart keeps the engines)."""
        ...
