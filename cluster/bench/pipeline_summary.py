"""Part 8's arithmetic (sync vs async vs pipeline on a long-tailed workload, issue 40): per-mode
figures from a run's metrics rows, the verdict against the goals, the prediction for engines on
their own devices, the table rows. Pure (no Ray, no torch): unit-tested.

One definition for all three modes, over the measured steps (the first, warm-up, left out):

  engine busy seconds   the metrics rows' `gen_s`: sync and async, the seconds the step's batch was
                        being generated (the collector's wall time around the engine's generate
                        call: Ray's call and vLLM's input/output handling included); pipeline, the
                        seconds the engine spent inside its engine steps since the last batch
                        (cluster/driver/pipeline.py). One engine (rollout.num_workers=1), so both are
                        one engine's seconds.
  window                the wall seconds those busy seconds were counted in: sync and async, the
                        step (`step_s`); pipeline, the engine's own interval between two batches,
                        `gen_s / pipeline/engine_busy_frac` (it runs from one `next_batch` to the
                        next, so it is offset from the step by the learner's train + sync: a pipeline
                        row's `gen_s` can exceed its `step_s`).
  engine idle fraction  1 - sum(engine busy seconds) / sum(window).
  generated tokens/s    sum(gen_tokens) / sum(window): every completion token the engine handed back,
                        in pipeline mode with those of groups then dropped as too stale.
  trained tokens/s      the completion tokens of the groups trained on (from completions.jsonl, which
                        logs every one) / sum(step_s): what the run learns from per second.
  step time             the median step_s.

The sync/async busy seconds include what the pipeline's leave out (the Ray call, detokenizing),
so if anything they flatter sync and async, not pipeline.

Prediction for engines on their own devices (`PREDICTION_MODEL`): each side keeps the seconds it
took here, and the schedule decides what overlaps: a sync step is the sum of its phases, an async
step max(engine side, learner side) step by step (one batch ahead), and the pipeline run
max(engine side, learner side) summed over the measured steps (its groups in flight even the steps
out). The engine side is generation + the time the engine is held for the weight update (sync_s;
pipeline: its pause) + what the collector waits for before the next batch (rewards, a reference
actor; async only: the pipeline scores in another thread); the learner side is train + sync (+ the
reference on the learner). Seconds measured while both sides shared the cores, so for async and
pipeline it errs slow.
"""
from __future__ import annotations

import math
import statistics

from cluster.bench.report import mean, ratio, steady

MODES = ("sync", "async", "pipeline")
GOAL_IDLE = 0.05  # pipeline's engine idle fraction must be under this
GOAL_RATIO = 1.3  # pipeline's generated tokens/s over async's must be at least this


def _num(r: dict, k: str) -> float:
    v = r.get(k)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v)) else 0.0


def engine_side(mode: str, r: dict, ref_actor: bool) -> float:
    """A step's seconds on the engine's side (see the module docstring)."""
    if mode == "pipeline":
        return _num(r, "gen_s") + _num(r, "pipeline/pause_s")
    return _num(r, "gen_s") + _num(r, "reward_s") + (_num(r, "ref_s") if ref_actor else 0.0) + _num(r, "sync_s")


def learner_side(r: dict, ref_actor: bool) -> float:
    return _num(r, "train_s") + _num(r, "sync_s") + (0.0 if ref_actor else _num(r, "ref_s"))


def predicted_seconds(mode: str, rs: list[dict], ref_actor: bool) -> float:
    """The measured steps' seconds with the engine on its own device (PREDICTION_MODEL)."""
    if mode == "sync":
        return sum(_num(r, k) for r in rs for k in ("gen_s", "reward_s", "ref_s", "train_s", "sync_s"))
    if mode == "async":
        return sum(max(engine_side(mode, r, ref_actor), learner_side(r, ref_actor)) for r in rs)
    return max(sum(engine_side(mode, r, ref_actor) for r in rs), sum(learner_side(r, ref_actor) for r in rs))


def window_s(mode: str, r: dict) -> float:
    """The wall seconds a row's `gen_s` was counted in (the module docstring)."""
    frac = _num(r, "pipeline/engine_busy_frac")
    if mode == "pipeline" and frac > 0 and _num(r, "gen_s") > 0:
        return _num(r, "gen_s") / frac
    return _num(r, "step_s")


def mode_summary(mode: str, rows: list[dict], *, ref_actor: bool, threads: dict | None = None, skip: int = 1,
                 trained_tokens: dict[int, int] | None = None) -> dict:
    """The part's figures for one mode's run (its metrics.jsonl training rows; `trained_tokens`: step ->
    completion tokens trained on, from completions.jsonl)."""
    rs = steady(rows, skip)
    if not rs:
        return {"mode": mode, "steps_measured": 0}
    steps_s, busy = sum(_num(r, "step_s") for r in rs), sum(_num(r, "gen_s") for r in rs)
    wall = sum(window_s(mode, r) for r in rs)
    tokens = sum(_num(r, "gen_tokens") for r in rs)
    trained = sum(trained_tokens.get(r.get("step"), 0) for r in rs) if trained_tokens is not None else None
    learner = sum(learner_side(r, ref_actor) for r in rs)
    pred = predicted_seconds(mode, rs, ref_actor)
    busy_frac = min(1.0, busy / wall) if wall > 0 else None
    learner_frac = min(1.0, learner / steps_s) if steps_s > 0 else None
    threads = threads or {}
    engine_threads = sum(v or 0 for k, v in threads.items() if k.startswith("rollout"))
    learner_threads = sum(v or 0 for k, v in threads.items() if k.startswith("learner"))
    verified = [r.get("sync_verified") for r in rs]
    return {
        "mode": mode, "steps_measured": len(rs), "window_s": wall, "steps_s": steps_s, "gen_tokens": tokens,
        "tokens_per_s": ratio(tokens, wall), "trained_tokens": trained, "trained_tokens_per_s": ratio(trained, steps_s),
        "engine_busy_frac": busy_frac, "engine_idle_frac": None if busy_frac is None else 1.0 - busy_frac,
        "engine_tokens_per_busy_s": ratio(tokens, busy),  # the engine's rate while it generates
        "step_s_median": statistics.median(_num(r, "step_s") for r in rs),
        "step_s_mean": steps_s / len(rs),
        "gen_s_mean": busy / len(rs), "learner_side_s_mean": learner / len(rs),
        "engine_side_s_mean": mean(engine_side(mode, r, ref_actor) for r in rs),
        "train_s_mean": mean(_num(r, "train_s") for r in rs), "sync_s_mean": mean(_num(r, "sync_s") for r in rs),
        "pause_s_mean": mean(_num(r, "pipeline/pause_s") for r in rs) if mode == "pipeline" else None,
        "learner_busy_frac": learner_frac,
        # threads that want a core at once, averaged over the run: over the machine's cores, they queue
        "core_demand": (engine_threads * busy_frac + learner_threads * learner_frac)
        if busy_frac is not None and learner_frac is not None else None,
        "threads": threads,
        "sync_verified_every_step": bool(verified) and all(v is True for v in verified),
        "weight_versions": [r.get("weight_version") for r in rows],
        "stale_groups": sum(_num(r, "stale_groups") for r in rs),
        "staleness_token_max": max((_num(r, "staleness/token_max") for r in rs), default=None),
        "versions_per_sequence_mean": mean(_num(r, "versions_per_sequence_mean") for r in rs if "versions_per_sequence_mean" in r),
        "predicted_step_s": pred / len(rs),
        "predicted_tokens_per_s": ratio(tokens, pred),
        "predicted_trained_tokens_per_s": ratio(trained, pred),
        "predicted_engine_idle_frac": None if not pred else max(0.0, 1.0 - busy / pred),
    }


def length_quantiles(lengths: list[int], cap: int) -> dict:
    """The completion lengths a run got: p50, p90, p99, max, mean, share at the cap."""
    if not lengths:
        return {"n": 0}
    xs = sorted(lengths)

    def q(p: float) -> int:  # nearest rank
        return xs[min(len(xs) - 1, max(0, math.ceil(p * len(xs)) - 1))]

    return {"n": len(xs), "mean": sum(xs) / len(xs), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": xs[-1],
            "capped_frac": sum(1 for x in xs if x >= cap) / len(xs), "cap": cap}


def verdict(modes: dict) -> dict:
    """The goals on this workload: pipeline's engine idle fraction < 5%, its tokens/s >= 1.3x async's."""
    p, a = modes.get("pipeline") or {}, modes.get("async") or {}
    idle, speedup = p.get("engine_idle_frac"), ratio(p.get("tokens_per_s"), a.get("tokens_per_s"))
    trained = ratio(p.get("trained_tokens_per_s"), a.get("trained_tokens_per_s"))
    out = {"pipeline_idle_frac": idle, "pipeline_vs_async_tokens": speedup, "pipeline_vs_async_trained_tokens": trained,
           "idle_met": idle is not None and idle < GOAL_IDLE,
           "speedup_met": speedup is not None and speedup >= GOAL_RATIO}
    parts = []
    if idle is None:
        parts.append("pipeline engine idle: n/a (no pipeline run)")
    else:
        parts.append(f"pipeline engine idle {100 * idle:.1f}% (goal < {100 * GOAL_IDLE:.0f}%: "
                     + ("met)" if out["idle_met"] else f"missed by {100 * (idle - GOAL_IDLE):.1f} points)"))
    if speedup is None:
        parts.append("pipeline / async tokens/s: n/a")
    else:
        parts.append(f"pipeline generated tokens/s {speedup:.2f}x async's (goal >= {GOAL_RATIO}x: "
                     + ("met)" if out["speedup_met"] else f"missed by {GOAL_RATIO - speedup:.2f}x)"))
    if trained is not None:
        parts.append(f"trained tokens/s {trained:.2f}x async's (stale groups dropped: {p.get('stale_groups', 0):.0f})")
    out["line"] = "verdict: " + "; ".join(parts)
    return out


PREDICTION_MODEL = ("engines on their own devices: each side keeps the seconds it took here and the schedule decides "
                    "what overlaps: sync = the sum of its phases, async = max(engine side, learner side) per step, "
                    "pipeline = max(engine side, learner side) over the measured steps (cluster/bench/pipeline_summary.py); "
                    "measured on shared cores, so it errs slow for async and pipeline")


def report_lines(part: dict) -> list[str]:
    """What the part prints under the table: the workload, the verdict, the prediction, the cores."""
    modes = part.get("modes", {})
    lines = []
    for mode in MODES:
        q = (modes.get(mode) or {}).get("lengths") or {}
        if q.get("n"):
            lines.append(f"lengths ({mode}, {q['n']} completions): mean {q['mean']:.1f}, p50 {q['p50']}, p90 {q['p90']}, "
                         f"p99 {q['p99']}, max {q['max']} of {q['cap']} ({100 * q['capped_frac']:.1f}% at the cap)")
    v = part.get("verdict")
    if v:
        lines.append(v["line"])
    p, a = modes.get("pipeline") or {}, modes.get("async") or {}
    pred = ratio(p.get("predicted_tokens_per_s"), a.get("predicted_tokens_per_s"))
    if p.get("predicted_tokens_per_s") is not None and pred is not None:
        lines.append(f"prediction ({PREDICTION_MODEL}): pipeline {p['predicted_tokens_per_s']:.0f} generated tokens/s "
                     f"({p.get('predicted_trained_tokens_per_s') or 0:.0f} trained), engine idle "
                     f"{100 * (p.get('predicted_engine_idle_frac') or 0):.1f}%; async {a['predicted_tokens_per_s']:.0f} "
                     f"({a.get('predicted_trained_tokens_per_s') or 0:.0f} trained); pipeline / async {pred:.2f}x")
    for mode in MODES:
        s = modes.get(mode) or {}
        if s.get("core_demand") is not None:
            lines.append(f"cores ({mode}): engine threads busy {100 * s['engine_busy_frac']:.0f}% of the time, learner "
                         f"{100 * s['learner_busy_frac']:.0f}%, threads {s['threads']}: {s['core_demand']:.2f} threads want "
                         f"a core on average; engine {s['engine_tokens_per_busy_s'] or 0:.0f} tokens per busy second")
    return lines


def table_rows(res: dict) -> list[tuple]:
    """Part 8's rows of the bench's table."""
    part = res.get("pipeline")
    if not part:
        return []
    modes, rows = part.get("modes", {}), []
    w = part.get("workload", {})
    if w:
        rows.append(("8 pipeline", "workload", "-", f"{w.get('steps')} steps x {w.get('prompts_per_step')} prompts x "
                     f"G={w.get('group_size')} x <= {w.get('max_new_tokens')} tokens, one engine, per mode"))
    for mode in MODES:
        s = modes.get(mode)
        if not s or not s.get("steps_measured"):
            continue
        rows += [
            ("8 pipeline", f"{mode}: generated tokens/s", s.get("tokens_per_s"),
             f"completion tokens / wall s, {s['steps_measured']} steps after warm-up"
             + (f" ({s.get('stale_groups', 0):.0f} groups dropped stale)" if mode == "pipeline" else "")),
            ("8 pipeline", f"{mode}: trained tokens/s", s.get("trained_tokens_per_s"),
             "completion tokens trained on / s of those steps"),
            ("8 pipeline", f"{mode}: engine idle fraction", s.get("engine_idle_frac"),
             f"1 - engine busy s / its window's s; engine {s.get('engine_tokens_per_busy_s') or 0:.0f} tokens per busy s"),
            ("8 pipeline", f"{mode}: step time (median)", s.get("step_s_median"),
             f"s; mean engine side {s.get('engine_side_s_mean') or 0:.2f}, learner side {s.get('learner_side_s_mean') or 0:.2f}"),
            ("8 pipeline", f"{mode}: own devices, predicted tokens/s", s.get("predicted_tokens_per_s"),
             f"generated; trained {s.get('predicted_trained_tokens_per_s') or 0:.0f}; engine idle "
             f"{100 * (s.get('predicted_engine_idle_frac') or 0):.1f}%; step {s.get('predicted_step_s') or 0:.2f} s"),
        ]
    v = part.get("verdict") or {}
    if v:
        rows += [("8 pipeline", "pipeline / async generated tokens/s", v.get("pipeline_vs_async_tokens"),
                  f"goal >= {GOAL_RATIO}: {'met' if v.get('speedup_met') else 'missed'}"),
                 ("8 pipeline", "pipeline / async trained tokens/s", v.get("pipeline_vs_async_trained_tokens"), ""),
                 ("8 pipeline", "pipeline engine idle fraction", v.get("pipeline_idle_frac"),
                  f"goal < {GOAL_IDLE}: {'met' if v.get('idle_met') else 'missed'}")]
    return rows
