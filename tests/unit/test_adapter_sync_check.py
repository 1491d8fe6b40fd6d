"""The LoRA adapter's verified sync (learner.lora_sync=adapter: actors/transport/lora_adapter.py AdapterSync.send)
over fake engines: every engine is asked for its fingerprint of the adapter it now serves and compared with what
was sent, vLLM's folding of the LoRA scaling into lora_B included. Issue 58's planted bugs found this check caught
by no test (tests/e2e/test_lora_end_to_end.py syncs but plants no fault; tests/e2e/test_learner_weight_sync.py plants
one on the full-weights path only): deleting the check passed the whole suite."""
from __future__ import annotations

import inspect
import json

import pytest
import torch

from actors.rollout import RolloutWorker
from actors.transport.fingerprint import SyncMismatch, sample
from actors.transport.lora_adapter import AdapterSync
from tests.fakes.ray_like import FakeActor, handle

CONFIG = json.dumps({"r": 4, "lora_alpha": 16})  # vLLM's scaling: 16 / 4 = 4, folded into lora_B on load
A, B = "base_model.model.layers.0.q_proj.lora_A.weight", "base_model.model.layers.0.q_proj.lora_B.weight"


class AdapterEngine(FakeActor):
    """An engine serving the learner's adapter as vLLM does (lora_B held times the scaling); `keeps_old`: it
    answers the load but goes on serving the adapter it had (the fault the check exists for)."""

    def __init__(self, index: int, keeps_old: bool = False, folds_scaling: bool = True):
        super().__init__(100 + index)
        self.index, self.keeps_old, self.folds_scaling = index, keeps_old, folds_scaling
        self.held: dict[str, torch.Tensor] = {A: torch.zeros(4, 8), B: torch.zeros(8, 4)}
        self.version = 0

    def load_adapter(self, tensors: dict, adapter_config: str, version: int) -> dict:
        c = json.loads(adapter_config)
        scaling = c["lora_alpha"] / c["r"] if self.folds_scaling else 1.0
        if not self.keeps_old:
            self.held = {n: t * scaling if ".lora_B." in n else t.clone() for n, t in tensors.items()}
        self.version = version
        return {"seconds": 0.0, "path": f"/tmp/raygrpo-lora-{self.pid}/{version}"}

    def weight_fingerprint(self, shapes: dict, version: int, adapter: bool = False) -> dict:
        assert adapter, "the adapter path asks for the adapter's fingerprint"
        held = {"values": {n: sample(n, self.held[n], version) for n in shapes},
                "dtypes": {n: "float32" for n in shapes}, "skipped": []}
        return {"engine": f"rollout worker {self.index} (pid {self.pid})", "version": self.version, "workers": [held]}


@pytest.fixture
def fake_ray(monkeypatch):
    """ray.put keeps the object, ray.get runs the fake calls, FakeRefs run when waited on (AdapterSync and
    verify_engines import ray where they call it)."""
    import ray

    monkeypatch.setattr(ray, "put", lambda obj: obj)
    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: [r.result("engine", "call", timeout or 0) for r in refs]
                        if isinstance(refs, list) else refs.result("engine", "call", timeout or 0))


def sender(engines: list[AdapterEngine], version_tensors: dict) -> AdapterSync:
    return AdapterSync(lambda: version_tensors, rank=0, rollout_handles=[handle(e) for e in engines],
                       config_json=CONFIG, timeout_s=5.0)


def adapter(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {A: torch.randn(4, 8, generator=g), B: torch.randn(8, 4, generator=g)}


def test_the_fake_engines_methods_are_the_rollout_workers():
    for name in ("load_adapter", "weight_fingerprint"):
        real, fake = inspect.signature(getattr(RolloutWorker, name)), inspect.signature(getattr(AdapterEngine, name))
        assert [(p.name, p.kind, p.default) for p in fake.parameters.values()] == \
            [(p.name, p.kind, p.default) for p in real.parameters.values()], name


def test_every_engine_holding_the_adapter_sent_is_verified(fake_ray):
    engines = [AdapterEngine(0), AdapterEngine(1)]
    out = sender(engines, adapter(1)).send(3)
    assert out["verified"] is True and out["weight_version"] == 3 and out["bytes"] == (32 + 32) * 4
    for e in engines:  # each loaded it, then was asked what it serves
        assert [c[0] for c in e.calls] == ["load_adapter", "weight_fingerprint"]
        assert torch.equal(e.held[B], adapter(1)[B] * 4.0)


def test_an_engine_that_kept_its_old_adapter_stops_the_sync_naming_it(fake_ray):
    engines = [AdapterEngine(0), AdapterEngine(1, keeps_old=True)]
    with pytest.raises(SyncMismatch, match=r"version 5: rollout worker 1 \(pid 101\) does not hold what the learner "
                                           r"sent: tensor base_model.*lora_A.weight: \d+ of \d+ sampled values differ"):
        sender(engines, adapter(2)).send(5)


def test_an_engine_serving_lora_b_without_the_scaling_is_caught(fake_ray):
    """The comparison folds the scaling into what was sent, as vLLM does on load: an engine that did not (or a
    check that forgot to) differs on lora_B only."""
    with pytest.raises(SyncMismatch, match=r"rollout worker 0 .*lora_B.weight: \d+ of \d+ sampled values differ") as e:
        sender([AdapterEngine(0, folds_scaling=False)], adapter(3)).send(1)
    assert "lora_A" not in str(e.value)
