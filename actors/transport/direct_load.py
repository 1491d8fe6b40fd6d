"""Weight updates that skip vLLM's `model.load_weights` once it is shown to be a plain copy.

vLLM's `load_weights` looks up the parameter of every incoming tensor and routes it through
that parameter's `weight_loader` (which stacks q/k/v into `qkv_proj`, gate/up into
`gate_up_proj`): about 70 us of Python per tensor, 3.7 ms of a 1.0M-parameter update, more
than the raw broadcast of the same bytes (2.3 ms; docs/benchmarks.md, "Weight sync"). For a
plain model in one worker (no tensor parallelism, no quantization) all it does is copy each
tensor into a row range of one parameter.

`DirectLoader` proposes those row ranges from the model's `packed_modules_mapping` and uses
them only after checking the proposal against vLLM itself, on the first update of a given
parameter list:
  1. the ranges tile every parameter of the model exactly (nothing left unwritten, nothing
     written twice), and
  2. after `load_weights` has loaded that update, every range equals its tensor.
From then on the same list is copied straight into the ranges. A proposal that fails either
check (a sharded or quantized model, a loader that transforms weights) keeps `load_weights`.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

Signature = tuple[tuple[str, tuple[int, ...], torch.dtype], ...]
Range = tuple[str, int, int]  # (vLLM parameter name, first row, rows)


class DirectLoader:
    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.params: dict[str, torch.nn.Parameter] = {}  # read at each proposal (the model's current ones)
        self.packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", None) or {})
        self.verified: dict[Signature, dict[str, torch.Tensor]] = {}  # name -> its rows in a parameter
        self.owners: dict[Signature, dict[str, str]] = {}  # name -> the vLLM parameter it is copied into
        self._ranges: dict[str, torch.Tensor] | None = None  # of the update under way, when it is copied directly
        self._checking: dict[str, Range] | None = None  # the proposal being checked, otherwise
        self._check_ok = False

    # ------------------------------------------------------------------ one update
    def begin(self, signature: Signature) -> bool:
        """Start an update of this parameter list; True when it will be copied directly."""
        if signature in self.verified:
            self._ranges, self._checking = self.verified[signature], None
            return True
        self._ranges, self._checking = None, self.propose(signature)
        self._check_ok = self._checking is not None
        return False

    def load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of the update `begin` started: by direct copies (a verified list) or by
        `load_weights`, checking the proposal against what it wrote."""
        if self._ranges is not None:  # one call for the bucket: a copy_ per tensor cost as much as the bytes
            torch._foreach_copy_([self._ranges[name] for name, _ in weights], [t for _, t in weights])
            return
        self.model.load_weights(weights)
        if self._check_ok:
            for name, tensor in weights:
                target = self._target(self._checking[name])
                if not torch.equal(target, tensor.to(target.dtype)):
                    self._check_ok = False
                    break

    def end(self, signature: Signature) -> None:
        """Finish an update: a list whose every bucket matched the proposal is verified."""
        if self._checking is not None and self._check_ok:
            self.verified[signature] = {name: self._target(r) for name, r in self._checking.items()}
            self.owners[signature] = {name: r[0] for name, r in self._checking.items()}
        self._checking = None

    # ------------------------------------------------------------------ the proposal
    def propose(self, signature: Signature) -> dict[str, Range] | None:
        """Each incoming name's range in vLLM's parameters, or None where they do not tile the
        model's parameters exactly."""
        self.params = dict(self.model.named_parameters())
        shapes = {name: shape for name, shape, _ in signature}
        ranges: dict[str, Range] = {}
        for name, shape in shapes.items():
            if not shape:
                return None  # a 0-dim tensor has no rows; leave such models to load_weights
            placed = self.place(name, shape, shapes)
            if placed is None:
                return None
            ranges[name] = placed
        return ranges if _tiles(ranges.values(), self.params) else None

    def place(self, name: str, shape: tuple[int, ...], shapes: dict[str, tuple[int, ...]]) -> Range | None:
        param = self.params.get(name)
        if param is not None:
            return (name, 0, shape[0]) if tuple(param.shape) == shape else None
        parts = name.split(".")
        for packed, shards in self.packed.items():
            for i, part in enumerate(parts):
                if part not in shards:
                    continue
                target = ".".join(parts[:i] + [packed] + parts[i + 1:])
                param = self.params.get(target)
                siblings = [shapes.get(".".join(parts[:i] + [s] + parts[i + 1:])) for s in shards]
                if param is None or any(s is None or s[1:] != shape[1:] for s in siblings):
                    return None
                if sum(s[0] for s in siblings) != param.shape[0] or tuple(param.shape[1:]) != shape[1:]:
                    return None
                start = sum(s[0] for s in siblings[:shards.index(part)])
                return target, start, shape[0]
        return None

    def _target(self, r: Range) -> torch.Tensor:
        name, start, rows = r
        return self.params[name].data.narrow(0, start, rows)


def signature_of(names: Iterable[str], shapes: Iterable[Iterable[int]], dtypes: Iterable[torch.dtype]) -> Signature:
    return tuple((n, tuple(s), d) for n, s, d in zip(names, shapes, dtypes))


def _tiles(ranges: Iterable[Range], params: dict[str, torch.nn.Parameter]) -> bool:
    """Whether the ranges cover the rows of every parameter exactly once."""
    by_param: dict[str, list[tuple[int, int]]] = {}
    for name, start, rows in ranges:
        by_param.setdefault(name, []).append((start, rows))
    if set(by_param) != set(params):
        return False
    for name, spans in by_param.items():
        end = 0
        for start, rows in sorted(spans):
            if start != end:
                return False
            end = start + rows
        if end != params[name].shape[0]:
            return False
    return True
