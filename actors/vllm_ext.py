"""Loaded in every vLLM process through the general-plugin entry point (setup.py:
`vllm.general_plugins: raygrpo = actors.vllm_ext:register`).

It does two things, both needed before any weight update can work on a CPU engine:

1. Registers the `gloo` weight-transfer backend (actors/gloo_transfer.py) with vLLM's engine
   and trainer factories, so `weight_transfer_config={"backend": "gloo"}` resolves.
2. The CPU re-pack fix. vLLM's CPU linear layers (and the embedding / LM head) compute from a
   packed copy of the weight (oneDNN handle or sgl-kernel layout) built once after loading,
   and linear layers then *drop* the original tensor (`remove_weight=True`). A later
   `model.load_weights(...)` therefore has nowhere to write, and even where the tensor is
   kept, the packed copy still holds the old values. So: keep the weight
   (`keep_cpu_weights`, patched in before the model loads) and rebuild the packed copies after
   an update (`repack_cpu_weights`, called by the gloo engine's `finish_weight_update`).
   Cost: the linear weights are held twice on CPU (plain + packed).

vLLM may call `register()` several times in one process (it says so); everything is idempotent.
"""
from __future__ import annotations

import torch

_MARK = "_raygrpo_keeps_weight"


def register() -> None:
    """The general-plugin hook: backends + (on CPU) the re-pack fix."""
    from actors.gloo_transfer import register_engine_backend, register_trainer_backends

    register_engine_backend()
    register_trainer_backends()
    if _on_cpu():
        keep_cpu_weights()


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def keep_cpu_weights() -> None:
    """Patch `dispatch_cpu_unquantized_gemm` to always keep the layer's weight.

    `vllm.model_executor.layers.linear` imports the function from `layers.utils` at call time,
    so replacing the module attribute reaches every layer loaded afterwards.
    """
    import vllm.model_executor.layers.utils as layer_utils

    original = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(original, _MARK, False):
        return

    def dispatch_keeping_weight(layer: torch.nn.Module, remove_weight: bool) -> None:
        original(layer, remove_weight=False)

    setattr(dispatch_keeping_weight, _MARK, True)
    dispatch_keeping_weight.__wrapped__ = original  # type: ignore[attr-defined]
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weight


def repack_cpu_weights(model: torch.nn.Module) -> int:
    """Rebuild the packed CPU GEMM copy of every 2-D layer weight from its current values.
    Returns the number of layers re-packed (0 off CPU)."""
    if not _on_cpu():
        return 0
    import vllm.model_executor.layers.utils as layer_utils

    count = 0
    for name, module in model.named_modules():
        if not hasattr(module, "cpu_linear") or getattr(module, "_cpu_skip_gemm_dispatch", False):
            continue
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.is_meta:
            continue
        if weight.numel() == 0:
            raise RuntimeError(
                f"vLLM dropped the weight of {name} after loading, so updates cannot reach it: the "
                "raygrpo vLLM plugin (actors.vllm_ext:register) was not loaded before the model. "
                "Is raygrpo pip-installed in this environment, and does VLLM_PLUGINS (if set) name it?"
            )
        layer_utils.dispatch_cpu_unquantized_gemm(module, remove_weight=False)
        count += 1
    return count
