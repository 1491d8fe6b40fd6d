"""Verified weight sync: after every update each engine reports a fingerprint of the weights it now
holds, and the learner compares it with the fingerprint of what it sent (issue 28).

A fingerprint is, per tensor, its values at SAMPLES flat positions, one in each of SAMPLES equal
blocks of the flattened tensor, at an offset drawn from the tensor's name and the weight version,
so successive updates look at different elements. The learner records them from the tensors as
it sends them (`Recorder`: after any LoRA merge, before any cast); an engine reads them back from
its own parameters once the update has finished (`engine_fingerprint`, run inside every vLLM
worker), or, when only the LoRA adapter travels, from the slots vLLM computes with
(`adapter_fingerprint`). The learner casts its values to the dtype the engine holds and compares
them as numbers: a copied weight is equal bit for bit, and vLLM's folding of the LoRA scaling into
lora_B leaves a rounding (TOLERANCE); a missed or partial update differs by an optimizer step,
orders of magnitude more.

This is backend-agnostic: WeightSync (every full-weight backend: gloo, nccl) and AdapterSync
call `verify_engines` after their send, with one Ray call per engine.

What it catches: an engine that kept old weights (an update left out, a load that wrote nothing or
wrote elsewhere), a tensor missing or mis-routed, an adapter that never reached vLLM's slots.
What it does not: a value changed only at positions this update did not sample (the next update
samples others); vLLM's CPU packed copies of big layers (it reads the weights they are packed
from). Under tensor parallelism each worker reports the samples that fall in its own shard
(tp_shards.py: vLLM's column-parallel layers split dim 0, row-parallel dim 1), so every shard is
compared with the matching slice of what was sent; a tensor no rule there places is still skipped.
"""
from __future__ import annotations

import time
import zlib

import torch

from actors.transport.direct_load import DirectLoader
from actors.transport.tp_shards import Shard, find_shard

SAMPLES = 16  # values per tensor: 50 tensors x 16 values take well under a millisecond on each side
TOLERANCE = 1e-6  # relative, after casting to the engine's dtype: see the module docstring


class SyncMismatch(RuntimeError):
    """An engine's weights are not what the learner sent."""


def positions(name: str, numel: int, version: int, k: int = SAMPLES) -> torch.Tensor:
    """k flat positions, one in each of k equal blocks of the tensor, at an offset drawn from (name, version)."""
    if numel <= k:
        return torch.arange(numel)
    block = numel // k
    offset = zlib.crc32(f"{name}@{version}".encode()) % block
    return torch.arange(k) * block + offset


def spread_positions(name: str, shape: tuple[int, ...], version: int, k: int = SAMPLES) -> torch.Tensor:
    """k flat positions of a tensor of `shape`: for a vector `positions`; for a matrix (rows x the rest), one
    row in each of k equal row blocks and the column moving across the columns with it, so that a shard
    along either dimension (tensor parallelism: tp_shards.py) holds about k / TP of them."""
    numel = 1
    for n in shape:
        numel *= n
    if len(shape) < 2 or numel <= k:
        return positions(name, numel, version, k)
    rows, cols = shape[0], numel // shape[0]
    h = zlib.crc32(f"{name}@{version}".encode())
    i = torch.arange(k)
    row = torch.clamp(i * rows // k + h % max(1, rows // k), max=rows - 1)
    col = (h // 65536 + i * cols // k) % cols
    return row * cols + col


def sample(name: str, tensor: torch.Tensor, version: int) -> list[float]:
    """The fingerprint values of one tensor, as float64 numbers (exact for every float dtype)."""
    flat = tensor.detach().reshape(-1)
    return flat[spread_positions(name, tuple(tensor.shape), version).to(flat.device)].double().cpu().tolist()


def sample_shard(name: str, shape: tuple[int, ...], shard: Shard, version: int) -> tuple[list[float], list[int]]:
    """The fingerprint values of a tensor at the positions (of its full `shape`) that `shard` holds, and
    which of the k samples they are."""
    values, at = [], []
    cols = 1 if len(shape) < 2 else shape[1]
    for i, flat in enumerate(spread_positions(name, shape, version).tolist()):
        index = (flat,) if len(shape) < 2 else (flat // cols, flat % cols)
        if shard.holds(index):
            values.append(shard.value(index))
            at.append(i)
    return values, at


class Recorder:
    """The learner's side: what it sent in this update, {name: values}, and each tensor's shape."""

    def __init__(self, version: int):
        self.version = version
        self.values: dict[str, list[float]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.values[name] = sample(name, tensor, self.version)
        self.shapes[name] = tuple(tensor.shape)


# ---------------------------------------------------------------------------- engine side
def engine_fingerprint(model: torch.nn.Module, shapes: dict[str, tuple[int, ...]], version: int) -> dict:
    """Inside a vLLM worker (FingerprintWorker): {"values": {name: samples}, "dtypes": {name: dtype},
    "skipped": [names], "at": {name: [sample indices]}} of the learner's tensors `shapes` as this worker
    holds them. A name vLLM stacks (q/k/v into qkv_proj, gate/up into gate_up_proj) is read from its rows
    of the stacked parameter; a name this worker holds a tensor-parallel shard of (tp_shards.py) is read
    at the sampled positions inside its shard, and "at" says which samples those are."""
    loader = DirectLoader(model)
    loader.params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    out: dict = {"values": {}, "dtypes": {}, "skipped": [], "at": {}}
    for name, shape in shapes.items():
        shape = tuple(shape)
        placed = loader.place(name, shape, shapes) if shape else None
        shard = find_shard(loader.params, modules, name, shape, loader.packed) if placed is None and 0 < len(shape) <= 2 else None
        if shard is not None:
            out["values"][name], out["at"][name] = sample_shard(name, shape, shard, version)
            out["dtypes"][name] = str(shard.local.dtype).removeprefix("torch.")
            out["tp"] = f"TP rank {shard.rank[0]} of {shard.rank[1]}"
            continue
        if placed is None:
            out["skipped"].append(name)
            continue
        param, start, rows = placed
        tensor = loader.params[param].data.narrow(0, start, rows)
        out["values"][name] = sample(name, tensor, version)
        out["dtypes"][name] = str(tensor.dtype).removeprefix("torch.")
    return out


def adapter_fingerprint(model: torch.nn.Module, shapes: dict[str, tuple[int, ...]], version: int,
                        slot: int = 0) -> dict:
    """Inside a vLLM worker: the LoRA adapter as vLLM computes with it, read from the slot `slot` of
    each LoRA layer (the engines start with max_loras=1: one slot). `shapes` are peft names
    (`...q_proj.lora_A.weight` [r, in], `...lora_B.weight` [out, r]); vLLM stacks q/k/v and gate/up
    into one layer with a slice each, and pads A's rows and B's columns to max_lora_rank."""
    layers = dict(model.named_modules())
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", None) or {})
    out: dict = {"values": {}, "dtypes": {}, "skipped": []}
    for name, shape in shapes.items():
        module, _, kind = name.removeprefix("base_model.model.").rpartition(".lora_")
        parts = module.split(".")
        layer, index = layers.get(module), 0
        for stacked, shards in packed.items():
            if layer is None and parts[-1] in shards:
                layer, index = layers.get(".".join(parts[:-1] + [stacked])), shards.index(parts[-1])
        stacks = getattr(layer, "lora_a_stacked" if kind.startswith("A") else "lora_b_stacked", None)
        if stacks is None or len(shape) != 2 or getattr(layer, "tp_size", 1) > 1:
            out["skipped"].append(name)
            continue
        tensor = stacks[index][slot, 0, :shape[0], :shape[1]]
        out["values"][name] = sample(name, tensor, version)
        out["dtypes"][name] = str(tensor.dtype).removeprefix("torch.")
    return out


class FingerprintWorker:
    """vLLM worker extension (the engines start with `worker_extension_cls` naming this class): the
    fingerprint is read inside every worker by method name (LLM.collective_rpc), so an engine whose
    workers are other processes (GPU) needs no pickled callable, which vLLM refuses by default."""

    def raygrpo_weight_fingerprint(self, shapes: dict, version: int, adapter: bool) -> dict:
        read = adapter_fingerprint if adapter else engine_fingerprint
        return read(self.get_model(), {name: tuple(shape) for name, shape in shapes.items()}, int(version))


WORKER_EXTENSION = f"{FingerprintWorker.__module__}.{FingerprintWorker.__qualname__}"


# ---------------------------------------------------------------------------- comparing
def _cast(values: list[float], dtype: str) -> list[float]:
    """The learner's values as the engine stores them (a bfloat16 engine holds rounded weights)."""
    return torch.tensor(values, dtype=torch.float64).to(getattr(torch, dtype)).double().tolist()


def differences(expected: Recorder, held: dict, scale: dict[str, float] | None = None) -> list[str]:
    """One line per tensor the engine holds otherwise than the learner sent. `scale`: per name, a
    factor the engine applied on load (vLLM folds the LoRA scaling into lora_B)."""
    out = []
    values, dtypes, skipped = held["values"], held["dtypes"], set(held["skipped"])
    for name, want in expected.values.items():
        if name in skipped:
            continue
        got = values.get(name)
        if got is None:
            out.append(f"{name}: not reported by the engine")
            continue
        factor = (scale or {}).get(name, 1.0)
        at = held.get("at", {}).get(name)  # a tensor-parallel shard: the samples inside it
        want = _cast([want[i] * factor for i in at] if at is not None else [v * factor for v in want], dtypes[name])
        bad = [i for i, (a, b) in enumerate(zip(want, got)) if not abs(a - b) <= TOLERANCE * max(1.0, abs(a))]
        if bad or len(got) != len(want):
            i = bad[0] if bad else 0
            where = f" in the shard of {held['tp']}" if at is not None and held.get("tp") else ""
            learner = f"{want[i]:.9g}" if i < len(want) else None
            out.append(f"tensor {name}{where}: {len(bad)} of {len(want)} sampled values differ "
                       f"(learner {learner}, engine {got[i] if i < len(got) else None!r})")
    if not values and expected.values:
        out.append("the engine could compare none of the tensors sent (every one skipped)")
    return out


def check(expected: Recorder, reports: list[dict], scale: dict[str, float] | None = None) -> None:
    """Raise SyncMismatch naming the first engine (and its tensors) that does not hold what was sent.
    `reports`: per engine {"engine": its label, "version": the version it stamped, "workers":
    [one fingerprint per vLLM worker]}."""
    for r in reports:
        problems = []
        if str(r["version"]) != str(expected.version):
            problems.append(f"weight version {r['version']!r}, expected {expected.version}")
        for held in r["workers"]:
            problems += differences(expected, held, scale)
        if problems:
            more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
            raise SyncMismatch(
                f"weight sync check failed after the update to version {expected.version}: {r['engine']} does not "
                f"hold what the learner sent: {'; '.join(problems[:3])}{more}. It would sample from other weights "
                "than the ones trained (a left-out or partial update); the run stops here")


def verify_engines(handles: list, expected: Recorder, *, adapter: bool, timeout_s: float,
                   scale: dict[str, float] | None = None) -> float:
    """Ask every engine (RolloutWorker.weight_fingerprint, one Ray call each) for its fingerprint of
    `expected`'s tensors and compare; returns the seconds it took. Raises SyncMismatch."""
    import ray

    t0 = time.perf_counter()
    refs = [h.weight_fingerprint.remote(expected.shapes, expected.version, adapter) for h in handles]
    check(expected, ray.get(refs, timeout=timeout_s), scale)
    return time.perf_counter() - t0
