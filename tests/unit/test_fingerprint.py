"""The sync fingerprint's parts without engines (the e2e test drives the real ones: a real engine that left an
update out, caught by a real learner's sync): tests/e2e/test_learner_weight_sync.py."""
from __future__ import annotations

import pytest
import torch

from actors.transport.fingerprint import (
    SAMPLES,
    WORKER_EXTENSION,
    FingerprintWorker,
    Recorder,
    SyncMismatch,
    adapter_fingerprint,
    check,
    engine_fingerprint,
    positions,
)


class Stacked(torch.nn.Module):
    """Shaped like a vLLM model: q/k/v stacked into one parameter, a norm held whole."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self):
        super().__init__()
        self.qkv_proj = torch.nn.Linear(8, 4 + 2 + 2, bias=False)
        self.norm = torch.nn.Parameter(torch.randn(8))


def sent(model: Stacked, version: int) -> Recorder:
    w = model.qkv_proj.weight.data
    r = Recorder(version)
    for name, t in {"q_proj.weight": w[:4], "k_proj.weight": w[4:6], "v_proj.weight": w[6:], "norm": model.norm}.items():
        r.add(name, t.clone())
    return r


def report(model, expected: Recorder, engine="rollout worker 0", version=None) -> dict:
    held = engine_fingerprint(model, expected.shapes, expected.version)
    return {"engine": engine, "version": expected.version if version is None else version, "workers": [held]}


def test_positions_cover_the_tensor_and_move_with_the_version():
    p1, p2 = positions("w", 1000, 1), positions("w", 1000, 2)
    assert len(p1) == SAMPLES and p1.max() < 1000 and len(set(p1.tolist())) == SAMPLES
    assert not torch.equal(p1, p2)
    assert positions("b", 5, 1).tolist() == [0, 1, 2, 3, 4]


def test_an_engine_holding_what_was_sent_passes_including_stacked_rows():
    torch.manual_seed(0)
    model = Stacked()
    expected = sent(model, 3)
    held = engine_fingerprint(model, expected.shapes, 3)
    assert held["skipped"] == [] and set(held["values"]) == set(expected.values)
    check(expected, [report(model, expected)])


def test_a_changed_row_range_is_named_with_its_engine():
    torch.manual_seed(0)
    model = Stacked()
    expected, stale = sent(model, 3), Stacked()
    stale.load_state_dict(model.state_dict())
    with torch.no_grad():
        stale.qkv_proj.weight[4:6] -= 1e-3  # k_proj's rows only, by an optimizer step's size
    with pytest.raises(SyncMismatch, match=r"rollout worker 1 does not hold .*: tensor k_proj.weight: 16 of 16"):
        check(expected, [report(model, expected), report(stale, expected, "rollout worker 1")])


def test_a_stale_version_stamp_is_reported():
    model = Stacked()
    expected = sent(model, 3)
    with pytest.raises(SyncMismatch, match="weight version 2, expected 3"):
        check(expected, [report(model, expected, version=2)])


def test_a_bfloat16_engine_is_compared_at_its_own_precision():
    torch.manual_seed(0)
    model = Stacked()
    expected = sent(model, 1)
    model.to(torch.bfloat16)
    check(expected, [report(model, expected)])


def test_adapter_slots_with_the_scaling_folded_into_b():
    """vLLM's LoRA layer of a stacked module: one slice per projection, padded to max_lora_rank."""
    class LoRALayer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lora_a_stacked = tuple(torch.zeros(1, 1, 8, 16) for _ in range(3))
            self.lora_b_stacked = tuple(torch.zeros(1, 1, 4, 8) for _ in range(3))

    class Model(torch.nn.Module):
        packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

        def __init__(self):
            super().__init__()
            self.qkv_proj = LoRALayer()

    torch.manual_seed(0)
    model, scaling = Model(), 2.0
    a, b = torch.randn(4, 16), torch.randn(4, 4)  # rank 4 of max 8
    model.qkv_proj.lora_a_stacked[1][0, 0, :4] = a
    model.qkv_proj.lora_b_stacked[1][0, 0, :, :4] = b * scaling
    expected = Recorder(5)
    expected.add("base_model.model.k_proj.lora_A.weight", a)
    expected.add("base_model.model.k_proj.lora_B.weight", b)
    held = adapter_fingerprint(model, expected.shapes, 5)
    assert held["skipped"] == []
    reports = [{"engine": "e", "version": 5, "workers": [held]}]
    check(expected, reports, scale={"base_model.model.k_proj.lora_B.weight": scaling})
    with pytest.raises(SyncMismatch, match="lora_B"):
        check(expected, reports)  # without the folded scaling the values differ


def test_the_worker_extension_reads_its_model_with_plain_arguments():
    """What LLM.collective_rpc calls in every vLLM worker; shapes arrive as lists (msgpack)."""
    class Worker(FingerprintWorker):
        def __init__(self, model):
            self.model = model

        def get_model(self):
            return self.model

    model = Stacked()
    expected = sent(model, 4)
    held = Worker(model).raygrpo_weight_fingerprint({n: list(s) for n, s in expected.shapes.items()}, 4, False)
    check(expected, [{"engine": "e", "version": 4, "workers": [held]}])
    assert WORKER_EXTENSION == "actors.transport.fingerprint.FingerprintWorker"
