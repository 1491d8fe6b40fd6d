"""8. pipeline: trainer.mode sync vs async vs pipeline on a long-tailed workload (issue 40, item 5).

The same model, config and token budget (steps x prompts x G x max_new_tokens) in all three modes,
one short `Trainer(cfg).run()` each (real training: the learner trains, the weights are synced and
their fingerprint verified every step), one after the other in one bench run. The completion
lengths are long-tailed from the model's own sampling: a random tiny model whose <eos> logit is
raised (cluster/models/longtail.py), so at temperature 1 most completions stop early and a few run
to rollout.max_new_tokens. Every completion is logged (metrics.completions_per_step = prompts x G),
and the lengths each run got are printed (p50/p90/p99/max, share at the cap).

Rewards: exact_match (the addition task; about 0 on a random model) and overlong_penalty with a
buffer of half the cap, so a group with a long completion has reward variance and the learner gets
a gradient (the zero-variance halt is off: many groups have none).

The figures, the verdict against the goals and the own-devices prediction: pipeline_summary.py.
`--parts pipeline` only (not in the default parts: about 3 x (start + steps) of runs).
"""
from __future__ import annotations

import json
from pathlib import Path

from cluster.bench.pipeline_summary import MODES, length_quantiles, mode_summary, verdict
from cluster.bench.report import BENCH_SETTINGS, load_average, model_spec, progress
from cluster.bench.schedule import bench_schedule
from cluster.bench.table import fmt_value
from cluster.config import load_config
from cluster.models.longtail import build_longtail_model

# The <eos> logit of the long-tailed model: at the default size (hidden 128, 4 layers) about a 2.6% chance
# of stopping per token at temperature 1: mean ~33 of 128 tokens, p50 ~24, p90 ~78, ~2% at the cap
# (HF sampling, 256 completions; longtail.py).
EOS_LOGIT = 1.4
# Applied after BENCH_SETTINGS, before the user's overrides.
PIPELINE_SETTINGS = [
    "data.num_eval=0",  # no evaluation before/after: the part measures the training steps only
    "rollout.max_new_tokens=128", "rollout.min_new_tokens=0", "rollout.max_model_len=160",
    "trainer.prompts_per_step=16", "trainer.group_size=8",
    "reward.functions=[exact_match,overlong_penalty]", "reward.overlong_buffer=64",
    "trainer.halt_on_zero_variance=false",
]


def run_part(cache: Path, hidden_size: int, num_layers: int, steps: int, user: list[str], out_dir: Path) -> dict:
    """The three runs; returns the part's results (pipeline_summary's figures per mode, with the rows)."""
    spec = model_spec(hidden_size, num_layers)
    model = build_longtail_model(cache / f"longtail-h{hidden_size}-l{num_layers}-eos{EOS_LOGIT}",
                                 cache / f"base-h{hidden_size}-l{num_layers}", spec, EOS_LOGIT)
    overrides = [*BENCH_SETTINGS, *PIPELINE_SETTINGS, f"model.path={model}", f"trainer.steps={steps}", *user]
    cfg = load_config(None, overrides)
    t, r = cfg.trainer, cfg.rollout
    overrides.append(f"metrics.completions_per_step={t.prompts_per_step * t.group_size}")  # every completion's length
    progress(f"pipeline: long-tailed model {model} (<eos> logit {EOS_LOGIT}); {steps} steps x {t.prompts_per_step} "
             f"prompts x G={t.group_size} x <= {r.max_new_tokens} tokens in each of {', '.join(MODES)}")
    modes = {}
    for mode in MODES:
        load_before = load_average()
        run_dir = out_dir / f"pipeline-{mode}"
        summary, rows = bench_schedule(overrides, mode, run_dir)
        # where the reference ran (reference.placement auto: the learner in sync, the actor otherwise)
        ref_actor = cfg.algo.beta > 0 and not summary["reference_on_learner"]
        logged = completion_lengths(run_dir)
        trained: dict[int, int] = {}
        for step, n in logged:
            trained[step] = trained.get(step, 0) + n
        s = mode_summary(mode, rows, ref_actor=ref_actor, threads=summary.get("threads"), trained_tokens=trained)
        s["reference"] = "actor" if ref_actor else ("learner" if cfg.algo.beta > 0 else "none")
        s["lengths"] = length_quantiles([n for _, n in logged], r.max_new_tokens)
        s["load_average"] = {"before": load_before, "after": load_average()}
        s["run_wall_s"] = summary.get("run_wall_s")
        s["rows"] = rows
        modes[mode] = s
        q = s["lengths"]
        progress(f"pipeline part, {mode}: {fmt_value(s.get('tokens_per_s'))} tokens/s, engine idle "
                 f"{fmt_value(s.get('engine_idle_frac'))}, {fmt_value(s.get('step_s_median'))} s/step; lengths p50 "
                 f"{q.get('p50')} p90 {q.get('p90')} max {q.get('max')}; load {s['load_average']['after']}")
    return {"workload": {"steps": steps, "prompts_per_step": t.prompts_per_step, "group_size": t.group_size,
                         "max_new_tokens": r.max_new_tokens, "eos_logit": EOS_LOGIT, "model": str(model)},
            "overrides": overrides, "modes": modes, "verdict": verdict(modes)}


def completion_lengths(run_dir: Path) -> list[tuple[int, int]]:
    """(step, token count) of every logged completion (completions.jsonl: every one trained on)."""
    path = run_dir / "completions.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if isinstance(row.get("num_tokens"), int):
                out.append((row.get("step"), row["num_tokens"]))
    return out
