"""Loaded in every vLLM process through the general-plugin entry point (setup.py:
`vllm.general_plugins: raygrpo = actors.transport.vllm_plugin:register`).

It does two things, both needed before any weight update can work on a CPU engine:

1. Registers every weight-transfer backend of actors/transport/registry.py with vLLM's engine
   and trainer factories (vLLM's own need nothing; ours, `gloo`, does), so
   `weight_transfer_config={"backend": "gloo"}` resolves.
2. The CPU re-pack fix. vLLM's CPU linear layers (and the embedding / LM head) compute from a
   packed copy of the weight (oneDNN handle or sgl-kernel layout) built once after loading,
   and linear layers then *drop* the original tensor (`remove_weight=True`). A later
   `model.load_weights(...)` therefore has nowhere to write, and even where the tensor is
   kept, the packed copy still holds the old values. So: keep the weight
   (`keep_cpu_weights`, patched in before the model loads) and rebuild the packed copies after
   an update (`repack_cpu_weights`, called by the gloo engine's `finish_weight_update`).
   Cost: the packed layers' weights are held twice on CPU (plain + packed). Small float32
   layers skip the packed copy and compute from the weight itself (`_computes_live`,
   rollout.cpu_pack_above_elements): as fast for them, and nothing to rebuild per update.

vLLM may call `register()` several times in one process (it says so); everything is idempotent.
"""
from __future__ import annotations

import os

import torch

from actors.transport.cpu_packing import DEFAULT_PACK_ABOVE_ELEMENTS, PACK_ABOVE_ENV
from actors.transport.registry import BACKENDS

_MARK = "_raygrpo_keeps_weight"
_LIVE = "_raygrpo_live_gemm"
_PACKED_LAYERS = "_raygrpo_packed_layers"


def register() -> None:
    """The general-plugin hook: backends + (on CPU) the re-pack fix."""
    for backend in BACKENDS.values():
        backend.register()
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
        if _computes_live(layer.weight):
            layer.cpu_linear = torch.nn.functional.linear
            setattr(layer, _LIVE, True)
            return
        original(layer, remove_weight=False)

    setattr(dispatch_keeping_weight, _MARK, True)
    dispatch_keeping_weight.__wrapped__ = original  # type: ignore[attr-defined]
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weight


def _computes_live(weight: torch.Tensor) -> bool:
    """Whether a layer computes from its weight itself (torch's `F.linear`, vLLM's own fallback)
    instead of a oneDNN-packed copy. Packing one weight costs about 0.4 ms whatever its size
    (oneDNN builds a primitive descriptor per handle), paid again at every weight update, and
    for small float32 weights the packed GEMM is no faster: on a 2-core AMD EPYC the 1.0M bench
    model's shapes (up to 1024 x 128) at M = 32, 256 and 2560 rows took the same time either way
    (within 10%), and whole generate calls at 1.0M and 7.9M -1% to +5% (docs/benchmarks.md)."""
    above = int(os.environ.get(PACK_ABOVE_ENV, DEFAULT_PACK_ABOVE_ELEMENTS))
    return (weight.dim() == 2 and not weight.is_meta and weight.dtype == torch.float32
            and weight.numel() <= above)


def repack_cpu_weights(model: torch.nn.Module, skip: set[int] | None = None) -> int:
    """Rebuild the packed CPU GEMM copy of every 2-D layer weight from its current values, but for
    the layers whose id() is in `skip` (the gloo engine re-packed them as their bucket loaded).
    Returns the number of layers re-packed (0 off CPU)."""
    if not _on_cpu():
        return 0
    import vllm.model_executor.layers.utils as layer_utils

    layers = [m for m in packed_layers_by_weight(model).values() if not skip or id(m) not in skip]
    for module in layers:
        layer_utils.dispatch_cpu_unquantized_gemm(module, remove_weight=False)
    return len(layers)


def repack_layer(module: torch.nn.Module) -> None:
    """Rebuild one layer's packed copy (of a layer `packed_layers_by_weight` lists)."""
    import vllm.model_executor.layers.utils as layer_utils

    layer_utils.dispatch_cpu_unquantized_gemm(module, remove_weight=False)


def packed_layers_by_weight(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The layers that compute from a packed copy of their weight, by their weight parameter's name
    ({} off CPU). Found once: walking the modules cost 0.3 ms of every update."""
    if not _on_cpu():
        return {}
    layers = model.__dict__.get(_PACKED_LAYERS)
    if layers is None:
        layers = model.__dict__[_PACKED_LAYERS] = dict(_packed_layers(model))
    return layers


def _packed_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(weight parameter name, layer) of the layers that compute from a packed copy of their weight."""
    layers = []
    for name, module in model.named_modules():
        if not hasattr(module, "cpu_linear") or getattr(module, "_cpu_skip_gemm_dispatch", False):
            continue
        if getattr(module, _LIVE, False):  # computes from the weight itself: nothing to rebuild
            continue
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.is_meta:
            continue
        if weight.numel() == 0:
            raise RuntimeError(
                f"vLLM dropped the weight of {name} after loading, so updates cannot reach it: the "
                "raygrpo vLLM plugin (actors.transport.vllm_plugin:register) was not loaded before the model. "
                "Is raygrpo pip-installed in this environment, and does VLLM_PLUGINS (if set) name it?"
            )
        layers.append((f"{name}.weight" if name else "weight", module))
    return layers
