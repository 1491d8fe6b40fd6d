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

from actors.pipeline import paused
from cluster.driver.pipeline_bounds import POLL_S


def loop_busy_s(worker, prompts: list[list[int]], group: int, length: int, update_halfway: bool = False) -> float:
    """The engine loop's busy seconds for `prompts` x `group` samples of exactly `length` tokens, polled every
    POLL_S as the feeder polls when nothing came; the loop is stopped after (a later generate needs it idle).
    `update_halfway`: once half the tokens are out, what a weight update does to the running requests besides
    loading the weights (actors/engine/weight_updates.py finish_weight_update: paused, the loop's
    rollout.kv_after_update choice; recompute, the default, prefills every running request again)."""
    cfg = worker.cfg
    saved = (cfg.min_new_tokens, cfg.max_new_tokens)
    cfg.min_new_tokens = cfg.max_new_tokens = length  # every sample runs to its length, as the plain call's
    worker.pipeline_start()
    try:
        before = worker.pipeline_take()["stats"]["busy_s"]
        worker.pipeline_submit([(i, p, group) for i, p in enumerate(prompts)])
        back, out, half = 0, None, len(prompts) * group * length / 2
        while back < len(prompts):
            time.sleep(POLL_S)
            out = worker.pipeline_take()
            back += len(out["rollouts"])
            if update_halfway and out["stats"]["tokens"] >= half and not back:
                update_halfway = False
                with paused(worker._loop):  # noqa: SLF001 - the update's own path, without new weights
                    worker._loop.after_update()  # noqa: SLF001
        return out["stats"]["busy_s"] - before
    finally:
        worker.pipeline_stop()
        cfg.min_new_tokens, cfg.max_new_tokens = saved


def measure_pipeline_loop(worker, plain_point, batch: int, lengths, group: int) -> list[dict]:
    """At `batch` sequences and each of `lengths`: a plain call's seconds (`plain_point(worker, batch, length)`,
    the generation points' own call), the loop's busy seconds for the same prompts x group, and the same with
    an update's cache choice halfway (`loop_update_busy_s`), each the better of two (after one warm-up)."""
    prompts = [[1 + (i + j) % 50 for j in range(8)] for i in range(max(1, batch // group))]
    loop_busy_s(worker, prompts[:1], group, 4)  # warm-up: the loop's first requests
    points = []
    for length in lengths:
        plain = min(plain_point(worker, batch, length)["seconds"] for _ in range(2))
        loop = min(loop_busy_s(worker, prompts, group, length) for _ in range(2))
        updated = min(loop_busy_s(worker, prompts, group, length, update_halfway=True) for _ in range(2))
        points.append({"batch": batch, "new_tokens": length, "prompt_tokens": len(prompts[0]), "plain_s": plain,
                       "loop_busy_s": loop, "loop_update_busy_s": updated})
    return points
