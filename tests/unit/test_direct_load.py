"""DirectLoader (actors/transport/direct_load.py) on stand-ins for vLLM models: it copies directly only
after vLLM's own loader was seen to do exactly that, and keeps the loader otherwise."""
from __future__ import annotations

import torch

from actors.transport.direct_load import DirectLoader, signature_of

# HF-side tensors of one layer: q/k/v and gate/up are stacked into one vLLM parameter each.
HF_SHAPES = {
    "layers.0.attn.q_proj.weight": (8, 4), "layers.0.attn.q_proj.bias": (8,),
    "layers.0.attn.k_proj.weight": (2, 4), "layers.0.attn.k_proj.bias": (2,),
    "layers.0.attn.v_proj.weight": (2, 4), "layers.0.attn.v_proj.bias": (2,),
    "layers.0.mlp.gate_proj.weight": (6, 4), "layers.0.mlp.up_proj.weight": (6, 4),
    "layers.0.mlp.down_proj.weight": (4, 6), "norm.weight": (4,),
}
STACKS = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


class VllmLike(torch.nn.Module):
    """Parameters laid out as vLLM's (stacked), and a `load_weights` that stacks like vLLM's
    weight loaders; `transform` stands for a loader that changes values (e.g. a quantizing one)."""

    packed_modules_mapping = STACKS

    def __init__(self, transform=lambda t: t, extra: bool = False):
        super().__init__()
        shapes = {"layers.0.attn.qkv_proj.weight": (12, 4), "layers.0.attn.qkv_proj.bias": (12,),
                  "layers.0.mlp.gate_up_proj.weight": (12, 4), "layers.0.mlp.down_proj.weight": (4, 6),
                  "norm.weight": (4,)}
        if extra:  # a parameter no incoming tensor writes (e.g. a separate, untied lm_head)
            shapes["lm_head.weight"] = (5, 4)
        self._names = list(shapes)
        for i, shape in enumerate(shapes.values()):
            self.register_parameter(f"p{i}", torch.nn.Parameter(torch.zeros(shape), requires_grad=False))
        self.transform, self.load_calls = transform, 0

    def named_parameters(self, *args, **kwargs):
        for i, name in enumerate(self._names):
            yield name, getattr(self, f"p{i}")

    def load_weights(self, weights):
        self.load_calls += 1
        params = dict(self.named_parameters())
        for name, tensor in weights:
            start, target = 0, name
            for packed, shards in STACKS.items():
                for shard in shards:
                    if f".{shard}." in name:
                        target = name.replace(shard, packed)
                        idx = shards.index(shard)
                        suffix = name.rsplit(".", 1)[1]
                        start = sum(HF_SHAPES[name.replace(shard, s).rsplit(".", 1)[0] + "." + suffix][0]
                                    for s in shards[:idx])
            params[target].data.narrow(0, start, tensor.shape[0]).copy_(self.transform(tensor))


def update(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(name, torch.randn(shape, generator=g)) for name, shape in HF_SHAPES.items()]


def run(loader: DirectLoader, weights, bucket: int = 4) -> bool:
    """One update in buckets of `bucket` tensors, as the gloo engine drives it."""
    sig = signature_of([n for n, _ in weights], [t.shape for _, t in weights], [t.dtype for _, t in weights])
    direct = loader.begin(sig)
    for i in range(0, len(weights), bucket):
        loader.load(weights[i:i + bucket])
    loader.end(sig)
    return direct


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_first_update_checks_then_later_ones_copy_directly_and_exactly():
    model, reference = VllmLike(), VllmLike()
    loader = DirectLoader(model)
    assert run(loader, update(0)) is False and model.load_calls == 3  # checked against load_weights
    for seed in (1, 2):
        weights = update(seed)
        calls = model.load_calls
        assert run(loader, weights) is True
        assert model.load_calls == calls  # not called: direct copies
        reference.load_weights(weights)
        for (name, got), want in zip(snapshot(model).items(), snapshot(reference).values()):
            assert torch.equal(got, want), name


def test_a_loader_that_changes_values_is_never_bypassed():
    model = VllmLike(transform=lambda t: 2 * t)
    loader = DirectLoader(model)
    for seed in range(3):
        assert run(loader, update(seed)) is False
    assert model.load_calls == 9


def test_a_parameter_left_unwritten_keeps_the_loader():
    loader = DirectLoader(VllmLike(extra=True))
    assert loader.propose(signature_of(HF_SHAPES, HF_SHAPES.values(), [torch.float32] * len(HF_SHAPES))) is None
    assert run(loader, update(0)) is False and run(loader, update(1)) is False


def test_shapes_that_do_not_fit_are_not_proposed():
    loader = DirectLoader(VllmLike())
    sharded = dict(HF_SHAPES, **{"layers.0.mlp.down_proj.weight": (4, 3)})  # e.g. a tensor-parallel shard
    assert loader.propose(signature_of(sharded, sharded.values(), [torch.float32] * len(sharded))) is None
    missing = {k: v for k, v in HF_SHAPES.items() if "k_proj" not in k}  # a shard of qkv not sent
    assert loader.propose(signature_of(missing, missing.values(), [torch.float32] * len(missing))) is None


def test_another_parameter_list_is_checked_again():
    model = VllmLike()
    loader = DirectLoader(model)
    run(loader, update(0))
    assert run(loader, update(1)) is True
    reordered = list(reversed(update(2)))  # a different list (order): its own check first
    assert run(loader, reordered) is False
    assert run(loader, list(reversed(update(3)))) is True


def test_a_verified_list_knows_the_parameter_each_tensor_lands_in():
    """The gloo engine re-packs a CPU layer once every tensor copied into its weight has arrived: it
    reads which vLLM parameter each incoming name lands in from `owners`, set only once verified."""
    model = VllmLike()
    loader = DirectLoader(model)
    sig = signature_of(HF_SHAPES, HF_SHAPES.values(), [torch.float32] * len(HF_SHAPES))
    assert not loader.begin(sig)
    loader.load([(n, torch.randn(s)) for n, s in HF_SHAPES.items()])
    assert sig not in loader.owners  # not before the update is checked
    loader.end(sig)
    assert loader.owners[sig]["layers.0.attn.k_proj.weight"] == "layers.0.attn.qkv_proj.weight"
    assert loader.owners[sig]["layers.0.mlp.up_proj.weight"] == "layers.0.mlp.gate_up_proj.weight"
    assert loader.owners[sig]["norm.weight"] == "norm.weight"
