"""The training schedules, one module each, chosen by trainer.mode (base.py: what a schedule is).

A new schedule is one module here and one line in `SCHEDULES` (tests/unit/test_schedules.py adds one so).
A user chooses it by name once the config's check of trainer.mode (cluster/config.py, which sits below the
driver and cannot read this table) lists it."""
from __future__ import annotations

from cluster.driver.schedules.async_ import AsyncSchedule
from cluster.driver.schedules.base import CheckpointParts, Schedule
from cluster.driver.schedules.pipeline import PipelineSchedule
from cluster.driver.schedules.sync import SyncSchedule

# trainer.mode -> the schedule's class, built with (run context, collector)
SCHEDULES: dict[str, type] = {
    "sync": SyncSchedule,
    "async": AsyncSchedule,
    "pipeline": PipelineSchedule,
}

__all__ = ["SCHEDULES", "CheckpointParts", "Schedule"]
