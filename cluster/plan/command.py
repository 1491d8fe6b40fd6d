"""`raygrpo plan CONFIG [key=value ...] --cluster local|SPEC [--profile FILE] [--json] [--write FILE]`.

Prints the prediction for the config as given, the placement the planner recommends and why, and every
candidate it weighed; --json prints one object instead (`as_given`, `recommended` with its `overrides`);
--write FILE writes the config with the recommended overrides applied, ready for `raygrpo train FILE`.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from cluster.config import ConfigError, RunConfig, apply_overrides, load_config
from cluster.driver.pipeline_bounds import in_flight_bound
from cluster.plan.cost import MODES, Candidate, Prediction, Workload
from cluster.plan.hardware import GB, ClusterSpec, ClusterSpecError, parse_cluster
from cluster.plan.profile import CalibrationProfile, MeasuredSpeeds, ProfileError, SpecSpeeds
from cluster.plan.search import Plan, PlanRefused, overrides, search
from cluster.plan.shapes import ModelShape, ShapeError, model_shape

DEFAULT_PROFILE = "runs/calibrate/profile.json"  # where `raygrpo bench --calibrate` writes by default
# Prompt tokens assumed for the built-in arithmetic tasks (a rendered task prompt is ~10-20 tokens)
TASK_PROMPT_TOKENS = 16
# Mean completion length as a share of rollout.max_new_tokens when nothing says more (--mean-new-tokens)
MEAN_NEW_FRACTION = 0.5
SHOWN_CANDIDATES = 12


@dataclass(frozen=True)
class PlanInputs:
    cfg: RunConfig
    cluster: ClusterSpec
    workload: Workload
    as_given: Candidate
    shape: ModelShape  # read once from config.json (make_plan)


def workload_of(cfg: RunConfig, local: bool, mean_new_tokens: float | None, prompt_tokens: int | None) -> Workload:
    r, t, d = cfg.rollout, cfg.trainer, cfg.data
    if prompt_tokens is None:
        room = r.max_model_len - r.max_new_tokens
        prompt_tokens = TASK_PROMPT_TOKENS if d.train.startswith("task:") else (d.max_prompt_tokens or room) // 2
    if mean_new_tokens is None:
        full = r.min_new_tokens >= r.max_new_tokens
        mean_new_tokens = r.max_new_tokens if full else max(r.min_new_tokens, MEAN_NEW_FRACTION * r.max_new_tokens)
    dtype = cfg.learner.dtype if cfg.learner.dtype != "auto" else ("float32" if local else "bfloat16")
    return Workload(prompts=t.prompts_per_step, group=t.group_size, prompt_tokens=int(prompt_tokens),
                    mean_new_tokens=float(min(mean_new_tokens, r.max_new_tokens)), max_new_tokens=r.max_new_tokens,
                    max_model_len=r.max_model_len, mu=cfg.learner.mu, beta=cfg.algo.beta, max_staleness=t.max_staleness,
                    dtype_bytes=4 if dtype == "float32" else 2, gpu_memory_utilization=r.gpu_memory_utilization,
                    eager=bool(r.enforce_eager), threads=(r.threads, cfg.learner.threads, cfg.reference.threads),
                    in_flight_groups=in_flight_bound(t), kv_recompute=r.kv_after_update == "recompute")


def as_given_candidate(cfg: RunConfig) -> Candidate:
    lrn = cfg.learner
    ref = "none" if cfg.algo.beta <= 0 else ("learner" if cfg.reference_on_learner() else "actor")
    return Candidate(engines=cfg.rollout.num_workers, tp=cfg.rollout.tensor_parallel_size, ranks=lrn.num_ranks,
                     zero_stage=int(lrn.zero_stage), micro_batch=lrn.micro_batch_size, mode=cfg.trainer.mode,
                     offload=lrn.offload_optimizer, gradient_checkpointing=lrn.gradient_checkpointing, reference=ref,
                     colocate=cfg.ray.placement == "colocate", spread="SPREAD" in cfg.ray.strategy)


def speeds_for(cluster: ClusterSpec, shape, wl: Workload, profile_path: str | None):
    if cluster.local:
        path = profile_path or DEFAULT_PROFILE
        if not Path(path).is_file():
            raise ProfileError(f"--cluster local needs this machine's calibration: no {path}; run `raygrpo bench "
                               "--calibrate CONFIG` first (or give --profile FILE)")
        return MeasuredSpeeds(CalibrationProfile.load(path), shape, path)
    speeds = SpecSpeeds(cluster, shape, wl.dtype_bytes)
    if profile_path:  # the measured software overheads replace the assumed ones
        prof = CalibrationProfile.load(profile_path)
        speeds.UPDATE_OVERHEAD_S, speeds.REWARD_S_PER_COMPLETION = prof.sync_overhead_s, prof.reward_s_per_completion
        speeds.source += f"; overheads measured in {profile_path}"
    return speeds


def make_plan(args) -> tuple[PlanInputs, Plan, list[str]]:
    cluster = parse_cluster(args.cluster, getattr(args, "efficiency", None))
    cfg = load_config(args.config, args.overrides, validate_paths=False)
    shape = model_shape(cfg.model.path)
    wl = workload_of(cfg, cluster.local, getattr(args, "mean_new_tokens", None), getattr(args, "prompt_tokens", None))
    given = as_given_candidate(cfg)
    speeds = speeds_for(cluster, shape, wl, args.profile)
    ref_choice = cfg.reference.placement if cfg.algo.beta > 0 and cfg.reference.placement != "auto" else None
    plan = search(shape, wl, speeds, cluster, given, ref_choice, modes=accepted_modes(args))
    for pr in plan.weighed:  # the fastest whose overrides the config check accepts with the rest of the config
        ovr = overrides(pr.candidate, local=cluster.local)
        try:
            load_config(args.config, [*args.overrides, *ovr], validate_paths=False)
        except ConfigError:
            continue
        plan.recommended = pr
        return PlanInputs(cfg, cluster, wl, given, shape), plan, ovr
    raise PlanRefused(f"every candidate that fits {cluster.describe()} breaks a rule of the config check with the rest "
                      f"of {args.config}; the fastest: {' '.join(overrides(plan.weighed[0].candidate, local=cluster.local))}")


def accepted_modes(args) -> tuple[str, ...]:
    """The schedules the rest of the config allows (pipeline mode refuses evaluations during training, ...)."""
    ok = []
    for mode in MODES:
        try:
            load_config(args.config, [*args.overrides, f"trainer.mode={mode}"], validate_paths=False)
            ok.append(mode)
        except ConfigError:
            pass
    return tuple(ok) or MODES


def plan_json(inputs: PlanInputs, plan: Plan, ovr: list[str], shape_name: str) -> dict:
    rec = {**plan.recommended.to_dict(), "overrides": ovr}
    return {"as_given": plan.as_given.to_dict(), "recommended": rec, "why": plan.why(),
            "cluster": inputs.cluster.describe(), "model": shape_name,
            "weighed": [{"placement": p.candidate.describe(), "step_s": p.step_s, "learner_peak_bytes": p.learner.peak}
                        for p in plan.weighed[:SHOWN_CANDIDATES]],
            "candidates_fit": len(plan.weighed), "candidates_refused": plan.refused}


def write_config(config_path: str | None, user_overrides: list[str], ovr: list[str], out: str | Path) -> Path:
    """The config file + the user's overrides + the plan's, as one YAML that `raygrpo train` reads."""
    data = (yaml.safe_load(Path(config_path).read_text()) or {}) if config_path else {}
    problems: list[str] = []
    data = apply_overrides(data, [*user_overrides, *ovr], problems)
    if problems:
        raise ConfigError(problems, "the plan's overrides")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    header = (f"# written by `raygrpo plan` from {config_path}: its placement, ZeRO stage, micro-batch and schedule\n"
              f"# overrides: {' '.join(ovr)}\n")
    out.write_text(header + yaml.safe_dump(data, sort_keys=False))
    load_config(out, [], validate_paths=False)  # what it wrote must load as a valid config
    return out


def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x / GB:.1f} GB"


def _lines(name: str, p: Prediction) -> list[str]:
    m = p.learner
    out = [f"{name}: {p.candidate.describe()}", f"  step {p.step_s:.2f} s: " + ", ".join(
        f"{k} {v:.2f}" for k, v in p.phases.items() if v > 0),
        f"  learner per device: {_gb(m.peak)} (params {_gb(m.params)}, grads {_gb(m.grads)}, optimizer {_gb(m.optimizer)}, "
        f"gathered {_gb(m.gathered)}, activations {_gb(m.activations)}, logits {_gb(m.logits)}, reference "
        f"{_gb(m.reference)}); host {_gb(m.host)}"]
    if p.engine:
        e = p.engine
        out.append(f"  engine per GPU: budget {_gb(e.budget)} = weights {_gb(e.weights)} + activations "
                   f"{_gb(e.activation_peak)} + overhead {_gb(e.overhead)} + KV cache {_gb(e.kv_cache)} "
                   f"({e.concurrent} sequences at once)")
    if p.candidate.mode == "pipeline":
        out.append(f"  engine idle {p.engine_idle_fraction:.0%}")
    out += [f"  does not fit: {x}" for x in p.problems]
    return out


def print_plan(inputs: PlanInputs, plan: Plan, ovr: list[str], shape) -> None:
    print(f"raygrpo plan: {shape.name} ({shape.params() / 1e9:.3f}B parameters) on {inputs.cluster.describe()}")
    print(f"  speeds: {plan.as_given.sources[0]}")
    for line in [*_lines("as given", plan.as_given), *_lines("recommended", plan.recommended)]:
        print(line)
    print(f"  why: {plan.why()}")
    print(f"  reference: {plan.recommended.candidate.reference}; rewards: CPU (reward functions' own processes)")
    print(f"weighed {len(plan.weighed) + plan.refused} candidates, {plan.refused} did not fit; the fastest that fit:")
    for p in plan.weighed[:SHOWN_CANDIDATES]:
        print(f"  {p.step_s:8.2f} s  {_gb(p.learner.peak):>9}  {p.candidate.describe()}")
    print("train with it: raygrpo train CONFIG " + " ".join(ovr) + "   (or --write FILE)")


def run_plan(args) -> int:
    try:
        inputs, plan, ovr = make_plan(args)
    except (PlanRefused, ClusterSpecError, ShapeError, ProfileError) as e:
        print(f"raygrpo plan: {e}", file=sys.stderr)
        return 2
    shape = inputs.shape
    if args.json:
        print(json.dumps(plan_json(inputs, plan, ovr, shape.name), indent=1))
    else:
        print_plan(inputs, plan, ovr, shape)
    if args.write:
        out = write_config(args.config, list(args.overrides or []), ovr, args.write)
        print(f"raygrpo plan: wrote {out} (raygrpo train {out})", file=sys.stderr if args.json else sys.stdout)
    return 0
