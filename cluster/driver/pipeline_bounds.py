"""The pipeline feeder's constants and bound (cluster/driver/pipeline.py), without its imports: what
`raygrpo plan` reads of how the feeder works (cluster/plan/cost.py) comes from here, the feeder's own."""
from __future__ import annotations

POLL_S = 0.02  # between two polls of the engines when none had anything


def in_flight_bound(t) -> int:
    """trainer.pipeline_groups_in_flight, 0 resolved: max_staleness x prompts_per_step.

    Why no more: groups sampled while step k trains (weights k-1) are trained at step k+1 only if at most
    prompts_per_step of them are ahead in the queue. With a bigger bound and engines that keep up with the
    learner, the queue holds more than a batch, groups wait a step longer, reach staleness max_staleness + 1
    and are dropped and generated again: with twice the bound the bench dropped 161 groups for 192 trained
    in 12 steps (docs/STATUS.md, "Pipeline mode"; tests/unit/test_pipeline.py simulates it). And never more than
    PIPELINE_STEPS_AHEAD steps of prompts by default, whatever max_staleness: with max_staleness 10^9 the feeder took
    10^9 prompts from the stream (issue 59)."""
    return t.pipeline_groups_in_flight or min(t.max_staleness, t.PIPELINE_STEPS_AHEAD) * t.prompts_per_step
