"""GPU layouts that cannot start, refused when the config is read (`raygrpo data`, `train`, `submit`: exit 2).

Nothing here asks Ray or CUDA: the rules read the config alone, so a laptop checks a cluster's layout.
Each problem names its key and the way out. Why each layout fails (vLLM 0.32, Ray 2.60, NCCL):

- NCCL refuses two ranks of one communicator on one device ("Duplicate GPU detected"). Two groups
  exist on GPU: the learner ranks' own (DeepSpeed over NCCL, learner/rank_setup.py) and, with the
  `nccl` weight transfer, learner rank 0 plus every engine worker. Ray gives an actor asking for a
  whole GPU one of its own, but packs actors asking for fractions together: two members of one group
  asking for fractions may land on one GPU.
- `ray.placement=colocate` puts learner rank i and engine i in one bundle, i.e. on one GPU: rank 0 and
  engine 0 are then both in the weight-transfer group. vLLM's `ipc` backend (CUDA IPC handles, made
  for such pairs) has not run here, so colocate is refused with NCCL rather than routed to it.
- vLLM runs one worker per GPU of a TP group; an engine with fewer GPUs than rollout.tensor_parallel_size
  fails at start. Under colocate vLLM takes the placement group's other bundles for its TP workers
  (vllm/v1/executor/ray_utils.py), i.e. the other learner ranks' GPUs.
- The NCCL sender is learner rank 0's GPU: learners on CPU cannot be NCCL's sender.
"""
from __future__ import annotations

from actors.transport.registry import resolve_backend


def gpu_layout_problems(cfg) -> list[str]:
    """Every layout problem of `cfg` (a RunConfig: rollout, learner, reference, algo, ray sections)."""
    r, lrn = cfg.rollout, cfg.learner
    backend = resolve_backend(r.weight_transfer_backend, r.num_gpus)
    colocate = cfg.ray.placement == "colocate"
    p = []
    if r.num_gpus > 0 and r.tensor_parallel_size > max(1.0, r.num_gpus):  # TP 1 may take a fraction
        p.append(f"rollout.tensor_parallel_size ({r.tensor_parallel_size}) > rollout.num_gpus ({r.num_gpus:g}): vLLM "
                 "runs one TP worker per GPU of its engine; set rollout.num_gpus to rollout.tensor_parallel_size "
                 "or lower rollout.tensor_parallel_size")
    if colocate and r.tensor_parallel_size > 1:
        p.append(f"ray.placement=colocate with rollout.tensor_parallel_size={r.tensor_parallel_size}: a colocated "
                 "bundle holds learner rank i and engine i, and vLLM would put the engine's other TP workers on "
                 "other learner ranks' bundles; use ray.placement=separate (each engine on GPUs of its own) or "
                 "rollout.tensor_parallel_size=1")
    if backend == "nccl":
        p += _nccl_problems(cfg, colocate)
    p += _fractional_learner_problems(lrn)
    p += _reference_problems(cfg)
    return p


def _nccl_problems(cfg, colocate: bool) -> list[str]:
    """The `nccl` weight transfer: its sender is learner rank 0's GPU, its receivers every engine worker."""
    r, lrn = cfg.rollout, cfg.learner
    chosen = f"rollout.weight_transfer_backend={r.weight_transfer_backend}" + (
        " (nccl, since the engines have GPUs)" if r.weight_transfer_backend == "auto" else "")
    if r.num_gpus == 0:
        return [f"{chosen} needs engines on GPUs (rollout.num_gpus > 0): vLLM's NCCL receiver runs on CUDA; "
                "on CPU use rollout.weight_transfer_backend=auto or gloo"]
    if lrn.num_gpus == 0:
        return [f"learner.num_gpus=0 (learner ranks on CPU) with {chosen}: the NCCL sender is learner rank 0 and "
                "needs a GPU; give the learners GPUs (learner.num_gpus: 1) or set rollout.weight_transfer_backend=gloo "
                "(a CPU sender, through host memory)"]
    if colocate:
        return [f"ray.placement=colocate with {chosen}: learner rank 0 and engine 0 share one GPU, and NCCL refuses "
                "two ranks of one communicator on the same device; use ray.placement=separate with whole GPUs "
                "(learner.num_gpus: 1, rollout.num_gpus: 1), or on one GPU rollout.weight_transfer_backend=gloo "
                "(the weights through host memory)"]
    fractional = [f"learner.num_gpus={lrn.num_gpus:g}"] if lrn.num_gpus < 1 else []
    if r.num_gpus < 1:
        fractional.append(f"rollout.num_gpus={r.num_gpus:g} x {r.num_workers} engine(s)")
    if r.num_gpus < 1 and (r.num_workers > 1 or lrn.num_gpus < 1):
        return [f"{' and '.join(fractional)} with {chosen}: learner rank 0 and every engine are ranks of one NCCL "
                "group, and Ray may pack two that ask for a fraction of a GPU onto the same GPU, which NCCL refuses; "
                "give each a whole GPU (rollout.num_gpus: 1, learner.num_gpus: 1) or set "
                "rollout.weight_transfer_backend=gloo"]
    return []


def _fractional_learner_problems(lrn) -> list[str]:
    """The learner ranks' own NCCL group (DeepSpeed on GPU)."""
    if lrn.num_ranks > 1 and 0 < lrn.num_gpus < 1:
        return [f"learner.num_gpus={lrn.num_gpus:g} with learner.num_ranks={lrn.num_ranks}: on GPU the ranks train "
                "over NCCL, and Ray may pack two ranks that ask for a fraction of a GPU onto the same GPU, which "
                "NCCL refuses; give each rank a whole GPU (learner.num_gpus: 1)"]
    return []


def _reference_problems(cfg) -> list[str]:
    """reference.placement=auto never puts a GPU run's reference model on CPU in silence."""
    lrn, ref = cfg.learner, cfg.reference
    if ref.placement != "auto" or cfg.algo.beta <= 0 or lrn.num_gpus == 0 or cfg.reference_on_learner():
        return []
    if ref.num_gpus > 0:
        return []
    return [f"reference.placement=auto with algo.beta={cfg.algo.beta:g} and the learner on GPU (learner.num_gpus="
            f"{lrn.num_gpus:g}) starts the reference actor, and reference.num_gpus=0 would run that model on CPU in "
            "float32; set reference.num_gpus (1, or a fraction to share a GPU), reference.placement=learner (a "
            "frozen copy on each learner rank's GPU), or reference.placement=actor to keep it on CPU on purpose"]
