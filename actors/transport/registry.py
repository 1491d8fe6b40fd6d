"""The one registry of weight-transfer backends (name -> backend), and what "auto" means.

Adding a backend: one module beside gloo.py and nccl.py with a `TransportBackend` (base.py), and
one line in BACKENDS. The config check (rollout.weight_transfer_backend), the driver's init info
(cluster/driver/worker_groups.py), the learner's WeightSync (learner/weight_sync.py), the engines' argument
(actors/rollout.py) and our vLLM plugin all ask here. No vLLM import: the driver reads it.
"""
from __future__ import annotations

from actors.transport.base import TransportBackend
from actors.transport.gloo import GlooBackend
from actors.transport.nccl import NcclBackend

BACKENDS: dict[str, TransportBackend] = {b.name: b for b in (GlooBackend(), NcclBackend())}


def backend(name: str) -> TransportBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown weight-transfer backend {name!r}; known: {', '.join(BACKENDS)}")
    return BACKENDS[name]


def resolve_backend(configured: str, engine_gpus: float) -> str:
    """The backend learner and engines use. "auto" is vLLM's NCCL when the engines run on GPUs, else
    our gloo engine. Decided from the engines' configured GPUs, not from this process's devices:
    the driver that tells the learners may have no GPU while the engines have."""
    if configured != "auto":
        return configured
    return "nccl" if engine_gpus > 0 else "gloo"
