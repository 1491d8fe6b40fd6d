"""Where a tensor-parallel vLLM worker holds a shard of a learner tensor (the fingerprint under TP, issue 57).

vLLM shards a weight along one dimension: column-parallel layers (q/k/v, gate/up, the vocabulary of the
embedding and LM head) along dim 0, their `output_dim`; row-parallel layers (o_proj, down_proj) along
dim 1, their `input_dim` (vllm/model_executor/layers/linear.py weight_loader, vocab_parallel_embedding.py).
TP rank r of t holds, of a tensor of length n along that dimension, the range

    [r * n_local, r * n_local + n_local)          n_local = its parameter's length there

cut at n where vLLM pads (the vocabulary). Stacked parameters (qkv_proj, gate_up_proj) hold each
learner tensor's local rows one after another: shard j has `output_sizes[j] / tp_size` rows; under GQA
with fewer key/value heads than TP ranks the k/v heads are replicated, so k and v's range is that of rank
`r // num_kv_head_replicas`.

`Shard` says where a worker's rows of a learner tensor lie in the learner's full tensor; the fingerprint
samples the full tensor's positions (fingerprint.py `spread_positions`) that fall inside it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shard:
    """A worker's part of a learner tensor: `local` (its values, as the worker holds them) is the full
    tensor's range [start, start + length) along `dim`."""

    local: torch.Tensor
    dim: int
    start: int
    length: int
    rank: tuple[int, int] = (0, 1)  # (TP rank, TP size) of the worker holding it

    def holds(self, index: tuple[int, ...]) -> bool:
        return self.start <= index[self.dim] < self.start + self.length

    def value(self, index: tuple[int, ...]) -> float:
        at = list(index)
        at[self.dim] -= self.start
        return float(self.local[tuple(at)])


def _owner(modules: dict[str, torch.nn.Module], param_name: str) -> torch.nn.Module | None:
    return modules.get(param_name.rpartition(".")[0])


def _rank(layer) -> tuple[int, int] | None:
    rank, size = getattr(layer, "tp_rank", None), getattr(layer, "tp_size", None)
    return (int(rank), int(size)) if rank is not None and size is not None else None


def direct_shard(param: torch.Tensor, layer, full: tuple[int, ...]) -> Shard | None:
    """A parameter of the learner tensor's own name that holds a shard of it (None: not sharded so)."""
    ranks = _rank(layer)
    if ranks is None or param.dim() != len(full):
        return None
    differ = [d for d in range(len(full)) if param.shape[d] != full[d]]
    dim = differ[0] if len(differ) == 1 else None  # the one dim the shard is cut along (vLLM's output/input_dim)
    if dim is None:
        return None
    local_length = param.shape[dim]
    start = ranks[0] * local_length
    length = max(0, min(local_length, full[dim] - start))  # the vocabulary is padded past n
    return Shard(param.data.narrow(dim, 0, length), dim, start, length, ranks)


def stacked_shard(param: torch.Tensor, layer, index: int, full: tuple[int, ...]) -> Shard | None:
    """Shard `index` of a stacked column-parallel parameter (qkv_proj, gate_up_proj) on this worker."""
    ranks, sizes = _rank(layer), getattr(layer, "output_sizes", None)
    if ranks is None or sizes is None or index >= len(sizes):
        return None
    rank, size = ranks
    local = [s // size for s in sizes]
    replicas = getattr(layer, "num_kv_head_replicas", 1) if index > 0 else 1  # GQA: k, v replicated
    start = (rank // replicas) * local[index]
    if local[index] > full[0] or len(full) != param.dim() or tuple(param.shape[1:]) != tuple(full[1:]):
        return None
    rows = param.data.narrow(0, sum(local[:index]), local[index])
    return Shard(rows, 0, start, local[index], ranks)


def find_shard(params: dict[str, torch.Tensor], modules: dict[str, torch.nn.Module], name: str,
               full: tuple[int, ...], packed: dict[str, list[str]]) -> Shard | None:
    """This worker's shard of the learner tensor `name` (shape `full`), or None where it holds none that
    these rules place (then the tensor is skipped, as before). `params`, `modules`: the model's
    named_parameters() and named_modules() as dicts, built once per fingerprint, not once per tensor."""
    param = params.get(name)
    if param is not None:
        return direct_shard(param, _owner(modules, name), full)
    parts = name.split(".")
    for stacked, shards in packed.items():
        for i, part in enumerate(parts):
            if part in shards:
                target = ".".join(parts[:i] + [stacked] + parts[i + 1:])
                if target in params:
                    return stacked_shard(params[target], _owner(modules, target), shards.index(part), full)
    return None
