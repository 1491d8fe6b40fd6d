"""The calibration's run fit: what a short real run of the model measured, against what the profile's
points alone predict for that run's config. The ratios carry what the points cannot see: the Ray actor
path of generation (1.5-3.3x the in-process `generate` here, docs/plan.md), DeepSpeed's learner beside a
plain torch step, the update's work in the engines, and the driver's per-step overhead.

    generation_factor   = (measured gen_s - a) / (predicted generation - a)      (the run's median step after
                          the first; a: the points' fixed seconds of the run's generate call, profile.py
                          call_and_token_costs): a factor on the decode steps alone, so a config with longer
                          completions carries it on its tokens and pays the call's fixed part once
    training_factor     = measured train_s / predicted training
    update_s_per_engine = measured sync_s  - predicted raw broadcast   (the engine's load and re-pack, the check:
                          the run has one engine; an update to E engines pays it E times on shared cores;
                          negative: the run's update beat the calibration's broadcast, paid once)
    reward_factor       = measured reward_s / predicted reward         (the scorer's processes, the driver's batching)
    overhead_s          = measured step_s  - (gen_s + reward_s + ref_s + train_s + sync_s)
    memory_offset_bytes = measured learner_peak_bytes - the analytic model's peak (cluster/plan/memory.py)

A plan for another config of the same model (schedule, engines, G, lengths) applies these to the points'
phases (profile.py MeasuredSpeeds); it is a fit on one run, checked on runs it was not fitted on
(cluster/bench/plan_check.py, docs/plan.md).
"""
from __future__ import annotations

import math

from cluster.config import RunConfig
from cluster.plan.command import as_given_candidate, workload_of
from cluster.plan.cost import predict
from cluster.plan.hardware import local_cluster
from cluster.plan.profile import CalibrationProfile, MeasuredSpeeds
from cluster.plan.shapes import model_shape

PHASE_KEYS = ("gen_s", "reward_s", "ref_s", "train_s", "sync_s")


class FitError(ValueError):
    pass


def predict_local(cfg: RunConfig, speeds_of, mean_new_tokens: float | None = None):
    """The `--cluster local` prediction of `cfg`'s own placement and schedule; `speeds_of(shape)` gives the speeds."""
    cluster = local_cluster()
    shape = model_shape(cfg.model.path)
    wl = workload_of(cfg, True, mean_new_tokens, None)
    return predict(shape, wl, as_given_candidate(cfg), speeds_of(shape), device_bytes=cluster.device.memory_bytes,
                   devices_per_node=cluster.devices_per_node, total_devices=cluster.total_devices, local=True), shape, wl


def fit_run(profile: CalibrationProfile, cfg: RunConfig, measured: dict, overrides_text: str = "") -> dict:
    """profile.run for `measured` (median phase seconds of a run of `cfg`, and its learner_peak_bytes)."""
    if cfg.trainer.mode != "sync":
        raise FitError(f"the run fit needs a sync run (its phases in a row), got trainer.mode={cfg.trainer.mode}")
    missing = [k for k in ("step_s", "gen_s", "train_s", "sync_s") if not measured.get(k)]
    if missing:
        raise FitError(f"the fit run's metrics lack {missing}: it trained no step after the first")
    raw = {}
    pr, _, wl = predict_local(cfg, lambda s: raw.setdefault("speeds", MeasuredSpeeds(profile, s, use_run=False)))
    ph = pr.phases
    # the run's one call per step, at the points' threads (the fit run pins them): its fixed part as measured
    call = raw["speeds"].call_s(math.ceil(wl.sequences / cfg.rollout.num_workers))
    phases = sum(measured.get(k) or 0.0 for k in PHASE_KEYS)
    peak = measured.get("learner_peak_bytes")
    return {"overrides_text": overrides_text, "measured": measured, "predicted_phases": ph,
            "generation_call_s": call,
            "generation_factor": max(measured["gen_s"] - call, 1e-9) / max(ph["generation"] - call, 1e-9),
            "training_factor": measured["train_s"] / max(ph["training"], 1e-9),
            "update_s_per_engine": (measured["sync_s"] - ph["weight_sync"]) / cfg.rollout.num_workers,
            "reward_factor": (measured.get("reward_s") or 0.0) / ph["reward"] if ph["reward"] > 0 else 1.0,
            "overhead_s": max(measured["step_s"] - phases, 0.0),
            "memory_offset_bytes": (peak - pr.learner.peak) if peak else 0.0}
