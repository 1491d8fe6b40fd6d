"""The fingerprint under tensor parallelism (issue 57, item 5): each TP worker reports the samples that fall
in its own shard, and the learner compares them with the matching slice of the full tensor it sent.

TP 2 is faked on CPU: two worker models laid out as vLLM lays out a Qwen2 layer on 2 ranks (its
weight_loaders: column-parallel q/k/v, gate/up and the padded vocabulary split dim 0, row-parallel o_proj
and down_proj split dim 1, GQA's single key/value head replicated on both ranks, the norm whole), with the
attributes vLLM's layers carry (tp_rank, tp_size, output_sizes, num_kv_head_replicas, input_dim/output_dim).
"""
from __future__ import annotations

import pytest
import torch

from actors.transport.fingerprint import SAMPLES, Recorder, SyncMismatch, check, engine_fingerprint

TP = 2
HEADS, KV_HEADS, HEAD, HIDDEN, FFN, VOCAB, PADDED_VOCAB = 4, 1, 2, 8, 12, 10, 12
P = "model.layers.0"
FULL = {
    "model.embed_tokens.weight": (VOCAB, HIDDEN),
    f"{P}.self_attn.q_proj.weight": (HEADS * HEAD, HIDDEN), f"{P}.self_attn.q_proj.bias": (HEADS * HEAD,),
    f"{P}.self_attn.k_proj.weight": (KV_HEADS * HEAD, HIDDEN), f"{P}.self_attn.k_proj.bias": (KV_HEADS * HEAD,),
    f"{P}.self_attn.v_proj.weight": (KV_HEADS * HEAD, HIDDEN), f"{P}.self_attn.v_proj.bias": (KV_HEADS * HEAD,),
    f"{P}.self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD),
    f"{P}.mlp.gate_proj.weight": (FFN, HIDDEN), f"{P}.mlp.up_proj.weight": (FFN, HIDDEN),
    f"{P}.mlp.down_proj.weight": (HIDDEN, FFN),
    "model.norm.weight": (HIDDEN,),
}


class Layer(torch.nn.Module):
    def __init__(self, rank: int, **params: torch.Tensor):
        super().__init__()
        self.tp_rank, self.tp_size = rank, TP
        for name, value in params.items():
            setattr(self, name, torch.nn.Parameter(value.clone()))


def rows(t: torch.Tensor, rank: int, parts: int = TP) -> torch.Tensor:
    n = t.shape[0] // parts
    return t[rank * n:(rank + 1) * n]


def worker(full: dict[str, torch.Tensor], rank: int) -> torch.nn.Module:
    """TP rank `rank`'s model, its parameters loaded from the learner's full tensors as vLLM's loaders do."""
    a, m = f"{P}.self_attn", f"{P}.mlp"
    model = torch.nn.Module()
    model.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    vocab = torch.cat([full["model.embed_tokens.weight"], torch.zeros(PADDED_VOCAB - VOCAB, HIDDEN)])
    embed = Layer(rank, weight=rows(vocab, rank))
    embed.weight.output_dim = 0
    kv_rank = rank // (TP // KV_HEADS)  # one key/value head, replicated on both ranks
    qkv = Layer(rank, weight=torch.cat([rows(full[f"{a}.q_proj.weight"], rank),
                                        rows(full[f"{a}.k_proj.weight"], kv_rank, KV_HEADS),
                                        rows(full[f"{a}.v_proj.weight"], kv_rank, KV_HEADS)]),
                bias=torch.cat([rows(full[f"{a}.q_proj.bias"], rank), rows(full[f"{a}.k_proj.bias"], kv_rank, KV_HEADS),
                                rows(full[f"{a}.v_proj.bias"], kv_rank, KV_HEADS)]))
    qkv.output_sizes, qkv.num_kv_head_replicas = [HEADS * HEAD, TP * HEAD, TP * HEAD], TP // KV_HEADS
    o = Layer(rank, weight=rows(full[f"{a}.o_proj.weight"].T, rank).T)
    o.weight.input_dim, o.weight.output_dim = 1, 0
    gate_up = Layer(rank, weight=torch.cat([rows(full[f"{m}.gate_proj.weight"], rank), rows(full[f"{m}.up_proj.weight"], rank)]))
    gate_up.output_sizes = [FFN, FFN]
    down = Layer(rank, weight=rows(full[f"{m}.down_proj.weight"].T, rank).T)
    down.weight.input_dim, down.weight.output_dim = 1, 0
    norm = Layer(rank, weight=full["model.norm.weight"])
    layer = torch.nn.Module()
    layer.self_attn, layer.mlp = torch.nn.Module(), torch.nn.Module()
    layer.self_attn.qkv_proj, layer.self_attn.o_proj = qkv, o
    layer.mlp.gate_up_proj, layer.mlp.down_proj = gate_up, down
    model.model = torch.nn.Module()
    model.model.embed_tokens, model.model.norm, model.model.layers = embed, norm, torch.nn.ModuleList([layer])
    return model


@pytest.fixture
def sent():
    torch.manual_seed(0)
    full = {name: torch.randn(shape) for name, shape in FULL.items()}
    recorder = Recorder(version=5)
    for name, tensor in full.items():
        recorder.add(name, tensor)
    return full, recorder


def reports(models, recorder: Recorder) -> list[dict]:
    return [{"engine": "rollout worker 0", "version": 5,
             "workers": [engine_fingerprint(m, recorder.shapes, recorder.version) for m in models]}]


def test_every_shard_is_compared_with_its_slice_of_what_was_sent(sent):
    full, recorder = sent
    models = [worker(full, r) for r in range(TP)]
    held = [engine_fingerprint(m, recorder.shapes, 5) for m in models]
    assert [h["skipped"] for h in held] == [[], []]  # nothing sharded is left out any more
    for name in FULL:
        if name in held[0]["at"] and name.split(".")[-2] not in ("k_proj", "v_proj"):
            # split between the ranks: together they hold every sample once (the vocabulary's padding none)
            samples = list(range(min(SAMPLES, torch.Size(FULL[name]).numel())))
            assert sorted(held[0]["at"][name] + held[1]["at"][name]) == samples, name
            assert held[0]["at"][name] and held[1]["at"][name], name
    kv = f"{P}.self_attn.k_proj.weight"
    assert held[0]["at"][kv] == held[1]["at"][kv] == list(range(min(SAMPLES, 2 * HIDDEN)))  # replicated
    check(recorder, reports(models, recorder))


@pytest.mark.parametrize("name", [f"{P}.mlp.down_proj.weight", f"{P}.self_attn.q_proj.weight",
                                  "model.embed_tokens.weight"])
def test_one_corrupted_shard_is_caught_and_named(sent, name):
    full, recorder = sent
    models = [worker(full, r) for r in range(TP)]
    target = {"down_proj": models[1].model.layers[0].mlp.down_proj.weight,
              "q_proj": models[1].model.layers[0].self_attn.qkv_proj.weight[:HEADS * HEAD // TP],
              "embed_tokens": models[1].model.embed_tokens.weight[:VOCAB - PADDED_VOCAB // TP]}
    with torch.no_grad():
        target[name.split(".")[-2]].add_(0.25)  # rank 1's shard only; rank 0's and the learner's are right
    with pytest.raises(SyncMismatch, match=rf"tensor {name} in the shard of TP rank 1 of 2: \d+ of \d+ sampled"):
        check(recorder, reports(models, recorder))
