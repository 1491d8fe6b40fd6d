"""LearnerWorker on a GPU: DeepSpeed (no ZeRO, and ZeRO-2) over NCCL, one rank in this process (no Ray).

Skipped where no GPU is visible (CI has none). Run by hand on a GPU box: it needs torch,
transformers, deepspeed and peft, but not Ray or vLLM, so a bare GPU image with those carried as
wheels will do (docs/STATUS.md says when it last ran and where).

- float32: one step equals a plain-torch step of the same batch (torch AdamW + clipping) to 1e-4, at ZeRO-0
  (what `zero_stage: auto` gives one float32 rank) and at ZeRO-2, and at ZeRO-0 with `learner.pack_sequences`
  (the micro-batch in one row: tests/e2e/test_packing_gpu.py has the forward alone);
- bfloat16 (dtype auto on a GPU) with the reference on the learner (a frozen copy on the GPU), at the
  default ZeRO stage (auto: 1 on one rank in bf16, DeepSpeed's BF16 optimizer with float32 gradient
  accumulation) and at ZeRO-2: the first pass's KL
  is 0 (policy == reference), and two steps change the weights;
- LoRA in bfloat16 with every other knob at its default: the reference is the model with its adapters
  off (first KL 0), and two steps move the adapters and nothing else.
"""
from __future__ import annotations

import math

import pytest
import torch
from learner_ranks import drop_deepspeed_groups as _teardown
from learner_ranks import in_process_rank as _rank
from learner_ranks import make_batch, max_weight_diff, reference_step
from learner_ranks import whole_weights as _weights

from learner import forward
from learner.config import AlgoConfig, LearnerConfig
from learner.packing import packed_completion_logits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.mark.parametrize(("zero_stage", "pack"), [(0, False), (2, False), (0, True)])
def test_float32_step_on_gpu_equals_plain_torch(tiny_model_dir, zero_stage, pack, monkeypatch):
    cfg = LearnerConfig(num_gpus=1, dtype="float32", zero_stage=zero_stage, lr=1e-3, adam_eps=1e-4, weight_decay=0.01,
                        grad_clip=0.5, micro_batch_size=2, pack_sequences=pack)
    algo, batch = AlgoConfig(), make_batch()
    packed_rows = []  # the micro-batches that went through the model as one packed row
    monkeypatch.setattr(forward, "packed_completion_logits",
                        lambda *a: packed_rows.append(a[1].shape) or packed_completion_logits(*a))
    rank = _rank(tiny_model_dir, cfg, algo)
    try:
        assert rank.info()["device"].startswith("cuda")
        metrics = rank.train_step(batch)
        assert bool(packed_rows) is pack
        losses, model, _ = reference_step(tiny_model_dir, batch, cfg, algo)
        assert not metrics["skipped"]
        assert metrics["loss"] == pytest.approx(losses[0], abs=1e-4)
        assert max_weight_diff(_weights(rank), model) <= 1e-4
    finally:
        _teardown()


@pytest.mark.parametrize("zero_stage", ["auto", 2])
def test_bfloat16_with_the_reference_on_the_learner(tiny_model_dir, zero_stage):
    cfg = LearnerConfig(num_gpus=1, zero_stage=zero_stage, lr=1e-3, micro_batch_size=2)  # dtype auto: bf16 on a GPU
    assert cfg.zero_stage == (1 if zero_stage == "auto" else zero_stage)  # bf16: stage 1 accumulates in fp32
    algo = AlgoConfig(beta=0.05)
    rank = _rank(tiny_model_dir, cfg, algo, reference_on_learner=True)
    try:
        assert next(rank.engine.module.parameters()).dtype == torch.bfloat16
        before = _weights(rank)
        first = rank.train_step(make_batch(seed=1))
        assert abs(first["kl"]) <= 1e-6 and first["ref_seconds"] > 0  # the frozen copy equals the policy
        second = rank.train_step(make_batch(seed=2))
        assert math.isfinite(second["loss"]) and not second["skipped"] and second["kl"] > 0
        after = _weights(rank)
        assert max((after[k] - before[k]).abs().max().item() for k in before) > 1e-4
    finally:
        _teardown()


def test_lora_in_bfloat16_trains_the_adapters_alone(tiny_model_dir):
    cfg = LearnerConfig(num_gpus=1, lr=1e-3, micro_batch_size=2, lora_rank=8)  # ZeRO auto (1), dtype auto (bf16)
    algo = AlgoConfig(beta=0.05)
    rank = _rank(tiny_model_dir, cfg, algo, reference_on_learner=True)
    try:
        assert next(rank.engine.module.parameters()).dtype == torch.bfloat16
        before = _weights(rank)
        assert any("lora_" in k for k in before)
        first = rank.train_step(make_batch(seed=1))
        assert abs(first["kl"]) <= 1e-6  # the reference is the model with its adapters off: lora_B starts at 0
        second = rank.train_step(make_batch(seed=2))
        assert math.isfinite(second["loss"]) and not second["skipped"] and second["kl"] > 0
        after = _weights(rank)
        moved = {k for k in before if (after[k] - before[k]).abs().max().item() > 0}
        assert moved, "no weight moved in two steps"
        assert all("lora_" in k for k in moved), sorted(k for k in moved if "lora_" not in k)[:5]
    finally:
        _teardown()
