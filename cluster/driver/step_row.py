"""A step's row of metrics.jsonl, as the driver assembles it from what the step produced: the batch's
collection statistics, the learner's metrics, the stopwatch's phases, the weight versions, the engines.
Its keys are cluster/run/metrics.py STEP_KEYS (the logger writes NaN for one that does not apply, e.g. kl
at beta=0, or every learner value after a step with nothing to train on)."""
from __future__ import annotations

from cluster.config import RunConfig
from cluster.driver.batch import Batch
from cluster.driver.rollout_pool import RolloutPool
from cluster.driver.worker_groups import Stopwatch
from cluster.run.metrics import LEARNER_KEYS, perf_metrics


def version_metrics(batch: Batch, trained_from: int) -> dict:
    """Per-token staleness (versions between the weights that sampled a token and `trained_from`, the
    weights this step's update started from) over the batch's completion tokens, and how many versions
    a sequence's tokens span on average (more than 1 only when an update lands mid-request)."""
    versions = [v for v in batch.versions() if v]
    if not versions:
        return {}
    stale = [trained_from - x for v in versions for x in v]
    return {"staleness/token_mean": sum(stale) / len(stale), "staleness/token_max": max(stale),
            "versions_per_sequence_mean": sum(len(set(v)) for v in versions) / len(versions)}


def step_row(cfg: RunConfig, batch: Batch, m: dict, sw: Stopwatch, *, step: int, version: int, pool: RolloutPool,
             learner_params: int | None) -> dict:
    """Step `step`'s row: `m` the learner's metrics (with "sync": the weight update's, or "skipped"), `version`
    the weights after its update, `learner_params` the model's parameter count (perf/mfu)."""
    stats = batch.stats.metrics()
    trained = 0 if m.get("skipped") else sum(len(p) + len(c) for p, c in zip(batch.prompt_ids, batch.completion_ids))
    perf = perf_metrics(stats["gen_tokens"], stats["gen_s"], sw.t["step_s"], trained, sw.t.get("train_s", 0.0),
                        params=learner_params, passes=cfg.learner.mu, peak_tflops=cfg.metrics.peak_tflops,
                        devices=cfg.learner.num_ranks)
    return {
        "step": step, "reward": stats["reward_mean"], **stats, **perf, **{k: m[k] for k in LEARNER_KEYS if k in m},
        "ref_s": sw.t.get("ref_s", 0.0), "train_s": sw.t.get("train_s", 0.0), "sync_s": sw.t.get("sync_s", 0.0),
        "step_s": sw.t["step_s"], "weight_version": version, **version_metrics(batch, version - 1),
        "staleness": version - 1 - batch.weight_version, "trained_groups": 0 if m.get("skipped") else len(batch.examples),
        "rollout_restarts": pool.restarts, "rollout/live_engines": len(pool.live),
        "update_skipped": m.get("skipped", False),
        "sync_bytes": m.get("sync", {}).get("bytes", 0),
        # every engine's fingerprint matched this step's update (and the seconds that check took);
        # absent (null) when no update was sent
        **({"sync_verified": m["sync"].get("verified", False), "sync_verify_s": m["sync"].get("verify_s", 0.0)}
           if "sync" in m else {}),
    }
