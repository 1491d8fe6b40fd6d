"""What "auto" means on each device, decided once for every process (engines, reference, learner ranks, driver).

Imports nothing of the project and not torch at import, so the driver, the learner and the bench may
all take it (docs/DESIGN.md, layering).
"""
from __future__ import annotations

import torch


def on_gpu(num_gpus: float) -> bool:
    """Whether a process that Ray gave `num_gpus` runs on a GPU (it asked for one and can see one)."""
    if num_gpus <= 0:
        return False

    return torch.cuda.is_available()


def resolve_dtype(dtype: str, gpu: bool) -> str:
    """A model's dtype: "auto" is bfloat16 on a GPU, float32 on CPU; any other value stands as given."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if gpu else "float32"


def resolve_enforce_eager(enforce_eager: bool | None, gpu: bool) -> bool:
    """vLLM's enforce_eager: None means eager on CPU (vLLM-CPU captures no graphs, and eager starts
    fast) and CUDA graphs on a GPU, where decoding without them is bound by kernel launches: on an
    H100 a 31.5M model decoded 32 x 128 tokens in 1.53 s eagerly and 0.30 s graph-captured
    (HF generate, dynamic vs static cache; docs/benchmarks.md, "On a GPU")."""
    return (not gpu) if enforce_eager is None else enforce_eager


def eager_cpu_engine_env(enforce_eager: bool | None, gpu: bool) -> dict[str, str]:
    """What an eager CPU engine's process sets before vLLM is imported: TORCHDYNAMO_DISABLE=1. vLLM's
    sampler wraps two small functions in torch.compile (the rank of each sampled token among the
    vocabulary, a random sample); on CPU every engine then traces and compiles them with inductor at
    its first request, about 2.4 of its 7.1 CPU-s of construction and warm-up on a loaded 2-core
    machine (a C++ compiler run too, on a cold cache). Eagerly they compute the same values (the same
    completions here; the e2e tests compare the engine's log-probs with HF's); an eager engine compiles nothing else. Nothing on a GPU,
    or where the user asked for compilation (rollout.enforce_eager=false)."""
    return {"TORCHDYNAMO_DISABLE": "1"} if not gpu and resolve_enforce_eager(enforce_eager, gpu) else {}

