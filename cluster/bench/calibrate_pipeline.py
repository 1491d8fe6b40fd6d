"""The calibration's pipeline point: what the pipeline's engine loop costs over a plain generate call.

In trainer.mode=pipeline an engine runs actors/pipeline.py's EngineLoop: a thread steps the engine, each
of a group's G samples is its own request (n=1) whose new tokens are read back every step, and the
driver's feeder polls it for finished groups every POLL_S (cluster/driver/pipeline_bounds.py), each poll
a call that takes the actor's GIL from the stepping thread. A run measured the loop's busy seconds 1.25x
a plain call's for the same work (docs/plan.md, session 21). Here the same engine does the same work both
ways, through the rollout actor's own pipeline calls (actors/engine/pipeline_loop.py), polled as the feeder
does; the loop's busy seconds (the engine's own counter, as a run's pipeline/engine_busy_frac uses) leave out
the feeder's waits, which the plan adds from the feeder's code (cluster/plan/cost.py feeder_wait_s).
"""
from __future__ import annotations

import time

from cluster.driver.pipeline_bounds import POLL_S


def loop_busy_s(worker, prompts: list[list[int]], group: int, length: int) -> float:
    """The engine loop's busy seconds for `prompts` x `group` samples of exactly `length` tokens, polled every
    POLL_S as the feeder polls when nothing came; the loop is stopped after (a later generate needs it idle)."""
    cfg = worker.cfg
    saved = (cfg.min_new_tokens, cfg.max_new_tokens)
    cfg.min_new_tokens = cfg.max_new_tokens = length  # every sample runs to its length, as the plain call's
    worker.pipeline_start()
    try:
        before = worker.pipeline_take()["stats"]["busy_s"]
        worker.pipeline_submit([(i, p, group) for i, p in enumerate(prompts)])
        back, out = 0, None
        while back < len(prompts):
            time.sleep(POLL_S)
            out = worker.pipeline_take()
            back += len(out["rollouts"])
        return out["stats"]["busy_s"] - before
    finally:
        worker.pipeline_stop()
        cfg.min_new_tokens, cfg.max_new_tokens = saved


def measure_pipeline_loop(worker, plain_point, batch: int, lengths, group: int) -> list[dict]:
    """At `batch` sequences and each of `lengths`: a plain call's seconds (`plain_point(worker, batch, length)`,
    the generation points' own call) and the loop's busy seconds for the same prompts x group, each the
    better of two (after one warm-up of the loop)."""
    prompts = [[1 + (i + j) % 50 for j in range(8)] for i in range(max(1, batch // group))]
    loop_busy_s(worker, prompts[:1], group, 4)  # warm-up: the loop's first requests
    points = []
    for length in lengths:
        plain = min(plain_point(worker, batch, length)["seconds"] for _ in range(2))
        loop = min(loop_busy_s(worker, prompts, group, length) for _ in range(2))
        points.append({"batch": batch, "new_tokens": length, "plain_s": plain, "loop_busy_s": loop})
    return points
