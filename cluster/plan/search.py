"""The candidates a plan weighs, the winner, and why it won; or the refusal, with the reason.

Candidates on a cluster of D devices (nodes of d): engines x TP (TP a power of two up to d), the rest
learner ranks (one device less when the reference model gets its own), ZeRO stage 0-3 with and without
optimizer offload, micro-batch 1-32, with and without gradient checkpointing, and each schedule. Every
candidate's memory is checked per device; the fastest that fits wins.

Colocated candidates (as NeMo-RL's colocated mode; `ray.placement=colocate`): k devices each hold learner
rank i and engine i (TP 1), both resident, so the learner's peak and the engine's
`gpu_memory_utilization` share of the device must fit together; they time-slice it, so the step is the
sum of the phases (cost.py), and the update goes through host memory (gloo). They free the devices
separate placement gives the other side, which wins where memory, not time, is short (one GPU).
On `local` there are no colocated candidates: the cores are shared in every placement (cores.py).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from cluster.plan.cost import MODES, Candidate, Prediction, Workload, predict
from cluster.plan.shapes import ModelShape

MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
# Learner peak over device memory above this does not fit: the allocator's fragmentation and the
# CUDA context take the rest (DeepSpeed's own estimate adds 50% on the host for the same reason).
DEVICE_HEADROOM = 0.9


class PlanRefused(ValueError):
    """Nothing fits the cluster; the message says what the smallest candidate needs."""


@dataclass
class Plan:
    as_given: Prediction
    recommended: Prediction
    weighed: list[Prediction]  # every candidate that fits, fastest first
    refused: int  # candidates that did not fit

    def why(self) -> str:
        win = self.recommended
        others = [p for p in self.weighed if p is not win]
        if not others:
            return "the only candidate that fits"
        runner = others[0]
        if rank_key(runner)[0] == rank_key(win)[0]:
            return (f"as fast as the next ({runner.candidate.describe()}, {runner.step_s:.2f} s) to 1%, and simpler: "
                    "no optimizer offload or recomputation unless needed, then the lower ZeRO stage, then less memory")
        phase = max(win.phases, key=lambda k: abs(runner.phases.get(k, 0) - win.phases[k]))
        return (f"{runner.step_s - win.step_s:.2f} s a step faster than the next ({runner.candidate.describe()}); "
                f"the biggest difference is {phase}: {win.phases[phase]:.2f} s against {runner.phases[phase]:.2f} s")


def candidates(total: int, per_node: int, wl: Workload, ref_choice: str | None, local: bool,
               modes: tuple[str, ...] = MODES) -> list[Candidate]:
    """Every layout of the module docstring that the config check accepts: learner ranks that divide the
    step's completions, no more engines than prompts."""
    beta = wl.beta
    tps = [t for t in (1, 2, 4, 8) if t <= per_node] if not local else [1]
    refs = ("none",) if beta <= 0 else ((ref_choice,) if ref_choice else ("learner", "actor"))
    out = []
    for tp, ref, mode in itertools.product(tps, refs, modes):
        ref_dev = 1 if ref == "actor" else 0
        max_engines = (total - ref_dev - 1) // tp if not local else min(total, 2)
        for engines in range(1, max_engines + 1):
            ranks = total - ref_dev - engines * tp if not local else None
            for r in ([ranks] if ranks else range(1, min(total, 2) + 1)):
                if r < 1 or wl.sequences % r or engines > wl.prompts:
                    continue
                for stage, offload, ckpt, mb in itertools.product((0, 1, 2, 3), (False, True), (False, True), MICRO_BATCHES):
                    # bf16 at stage 0 accumulates gradients in bf16: the config check refuses it (learner/config.py)
                    if (offload and stage == 0) or (local and (offload or ckpt)) or (stage == 0 and wl.dtype_bytes < 4):
                        continue
                    out.append(Candidate(engines, tp, r, stage, mb, mode, offload, ckpt, ref))
    return out + ([] if local else colocated_candidates(total, wl, refs))


def colocated_candidates(total: int, wl: Workload, refs: tuple[str, ...]) -> list[Candidate]:
    """k devices, each holding learner rank i and engine i (TP 1), in the sync schedule (time-sliced: the
    schedules would not overlap anything); the reference on the learner or on a device of its own."""
    out = []
    for ref in refs:
        for k in range(1, total - (1 if ref == "actor" else 0) + 1):
            if wl.sequences % k or k > wl.prompts:
                continue
            for stage, offload, ckpt, mb in itertools.product((1, 2, 3), (False, True), (False, True), MICRO_BATCHES):
                out.append(Candidate(k, 1, k, stage, mb, "sync", offload, ckpt, ref, colocate=True))
    return out


def search(shape: ModelShape, wl: Workload, speeds, cluster, as_given: Candidate, ref_choice: str | None = None,
           modes: tuple[str, ...] = MODES) -> Plan:
    dev, local = cluster.device, cluster.local
    kw = dict(device_bytes=dev.memory_bytes, headroom=DEVICE_HEADROOM, devices_per_node=cluster.devices_per_node,
              total_devices=cluster.total_devices, local=local)
    given = predict(shape, wl, as_given, speeds, **kw)
    fits, refused, smallest = [], 0, None
    for c in candidates(cluster.total_devices, cluster.devices_per_node, wl, ref_choice, local, modes):
        pr = predict(shape, wl, c, speeds, **kw)
        if local and pr.learner.peak * c.ranks > dev.memory_bytes * DEVICE_HEADROOM:
            pr.problems.append(f"learner ranks need {pr.learner.peak * c.ranks / 1e9:.1f} GB of RAM together")
        if pr.fits:
            fits.append(pr)
        else:
            refused += 1
            if smallest is None or pr.learner.peak < smallest.learner.peak:
                smallest = pr
    if not fits:
        why = "; ".join(smallest.problems) if smallest else "no candidate could be formed (too few devices)"
        raise PlanRefused(f"nothing fits {cluster.describe()} for {shape.name} ({shape.params() / 1e9:.2f}B parameters): "
                          f"the smallest candidate ({smallest.candidate.describe() if smallest else '-'}) {why}. "
                          "Use more or larger devices, a shorter rollout.max_model_len, or a smaller model")
    fits.sort(key=rank_key)
    return Plan(given, fits[0], fits, refused)


def rank_key(p: Prediction) -> tuple:
    """Fastest first; among equally fast (to 1%), the simpler: no offload, no recomputation, fewer
    devices for the learner's states, then the least memory."""
    c = p.candidate
    return (round(math.log(max(p.step_s, 1e-9)) / math.log(1.01)), c.offload, c.gradient_checkpointing, c.zero_stage,
            c.tp, p.learner.peak)


def overrides(c: Candidate, per_engine_gpus: float = 1.0, local: bool = False) -> list[str]:
    """The config keys that make a run take placement `c` (`raygrpo plan --write`, `raygrpo train ... KEY=V`)."""
    out = [f"rollout.num_workers={c.engines}", f"learner.num_ranks={c.ranks}", f"learner.zero_stage={c.zero_stage}",
           f"learner.offload_optimizer={str(c.offload).lower()}", f"learner.micro_batch_size={c.micro_batch}",
           f"learner.gradient_checkpointing={str(c.gradient_checkpointing).lower()}", f"trainer.mode={c.mode}",
           f"ray.placement={'colocate' if c.colocate else 'separate'}", "ray.strategy=PACK"]
    out.append(f"learner.offload_params={str(c.offload and c.zero_stage == 3).lower()}")
    if c.colocate:  # one device for the pair (half each in Ray's count), the update through host memory
        out += ["rollout.tensor_parallel_size=1", "rollout.num_gpus=0.5", "learner.num_gpus=0.5",
                "rollout.weight_transfer_backend=gloo"]
    elif not local:
        out += [f"rollout.tensor_parallel_size={c.tp}", f"rollout.num_gpus={c.tp * per_engine_gpus:g}", "learner.num_gpus=1"]
    if c.reference != "none":
        out.append(f"reference.placement={c.reference}")
        if not local:
            out.append(f"reference.num_gpus={1 if c.reference == 'actor' else 0}")
    return out
