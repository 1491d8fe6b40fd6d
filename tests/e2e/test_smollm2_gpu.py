"""The real pretrained model (SmolLM2-135M-Instruct, the `smollm2_dir` fixture) in the learner on a GPU.

Skipped where no GPU is visible (CI has none) or where the model cannot be built (the fixture says
why). Needs torch, transformers, deepspeed and gguf, not Ray or vLLM, so it runs on a bare GPU image
with those carried as wheels and the fixture's GGUF file placed in its cache (docs/STATUS.md says when
it last ran and where). The CPU tests (test_smollm2.py, test_smollm2_logprobs.py) cover the engines.

- float32, every other knob at its default (ZeRO-0 on one rank): the learner's log-probs of chat
  transcripts on the GPU equal transformers' on the CPU to 1e-4, before and after an update, and the
  output layer is still the input embedding (tied) after it;
- bfloat16 at every default (dtype auto, ZeRO auto), the reference on the learner: a GRPO step of 4 chat
  prompts x G=4 completions of real text starts at KL 0 and moves the weights; its peak GPU memory is
  printed and stays under 6 GiB;
- a greedy chat answer in bfloat16 on the GPU is coherent and right, as the float32 CPU one is
  ("The capital of France is Paris."); whether the two are equal is printed.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from hf_logprobs import chat, hf_logprobs, max_diff
from learner_ranks import drop_deepspeed_groups as _teardown
from learner_ranks import in_process_rank as _rank
from learner_ranks import whole_weights as _weights

from cluster.models.smollm2 import MARKER, greedy_answer, incoherence
from learner.batch import TrainBatch
from learner.config import AlgoConfig, LearnerConfig

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
              pytest.mark.usefixtures("no_tf32")]  # tests/e2e/conftest.py
QUESTIONS = ["What is 7 times 8?", "Name a primary colour.", "How many legs does a spider have?",
             "What is the opposite of hot?"]
ANSWERS = ["7 times 8 is 56. Multiplication is repeated addition, so adding 8 seven times gives 56 in all.",
           "Red is a primary colour. The others are blue and yellow, and mixing them makes the rest.",
           "A spider has eight legs. Insects have six, which is one way to tell the two apart.",
           "The opposite of hot is cold. Warm and cool lie between the two on the scale."]


def _batch(tokenizer, group_size=4, completion_tokens=32) -> TrainBatch:
    """4 chat prompts x G completions of real text: each prompt's answer cut to `completion_tokens` at G offsets."""
    prompts, comps = [], []
    for q, a in zip(QUESTIONS, ANSWERS):
        ids = tokenizer(a, add_special_tokens=False)["input_ids"] * 2
        for g in range(group_size):
            prompts.append(chat(tokenizer, q))
            comps.append(ids[g:g + completion_tokens])
    advantages = [1.0 if i % 2 else -1.0 for i in range(len(comps))]
    return TrainBatch(prompt_ids=prompts, completion_ids=comps, advantages=advantages,
                      behavior_logp=[[-2.0] * len(c) for c in comps], pad_id=tokenizer.pad_token_id)


def test_float32_learner_on_gpu_equals_transformers_on_cpu_before_and_after_an_update(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    seqs = [chat(tokenizer, q) + tokenizer(a, add_special_tokens=False)["input_ids"] for q, a in zip(QUESTIONS, ANSWERS)]
    cpu = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    rank = _rank(smollm2_dir, LearnerConfig(num_gpus=1, dtype="float32", lr=1e-4), AlgoConfig())
    try:
        assert rank.cfg.zero_stage == 0 and rank.info()["device"].startswith("cuda")
        before = max_diff(rank.sequence_logprobs(seqs), hf_logprobs(cpu, seqs))
        print(f"float32 log-probs, GPU learner vs CPU transformers, before the update: max |diff| {before:.2e}")
        assert before <= 1e-4
        metrics = rank.train_step(_batch(tokenizer))
        assert math.isfinite(metrics["loss"]) and not metrics["skipped"]
        module = rank.engine.module
        assert module.lm_head.weight is module.model.embed_tokens.weight  # the output layer is still the embedding
        weights = _weights(rank)  # named_parameters: the tied matrix once, as embed_tokens
        moved = max((weights[k] - v).abs().max().item() for k, v in cpu.state_dict().items() if k in weights)
        assert moved > 1e-6, "the update moved nothing"
        missing, _ = cpu.load_state_dict(weights, strict=False)
        assert missing == ["lm_head.weight"] or not missing, missing  # tied: filled by the embedding
        cpu.tie_weights()
        after = max_diff(rank.sequence_logprobs(seqs), hf_logprobs(cpu, seqs))
        print(f"after one update (largest weight change {moved:.2e}): max |diff| {after:.2e}")
        assert after <= 1e-4
    finally:
        _teardown()


def test_bfloat16_at_every_default_trains_from_kl_zero_with_the_reference_on_the_learner(smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    torch.cuda.reset_peak_memory_stats()
    cfg = LearnerConfig(num_gpus=1)  # dtype auto (bf16 on a GPU), zero_stage auto (1: fp32 accumulation), micro-batch 8
    rank = _rank(smollm2_dir, cfg, AlgoConfig(beta=0.001), reference_on_learner=True)
    try:
        assert cfg.zero_stage == 1 and next(rank.engine.module.parameters()).dtype == torch.bfloat16
        start = _weights(rank)
        first = rank.train_step(_batch(tokenizer))
        assert abs(first["kl"]) <= 1e-6 and math.isfinite(first["loss"]) and not first["skipped"]
        second = rank.train_step(_batch(tokenizer))
        assert math.isfinite(second["loss"]) and not second["skipped"]
        moved = max((w - start[k]).abs().max().item() for k, w in _weights(rank).items())
        peak = torch.cuda.max_memory_allocated() / 2**30
        print(f"bf16 defaults: kl {first['kl']:.1e} then {second['kl']:.2e}, largest weight change {moved:.2e}, "
              f"peak GPU memory {peak:.2f} GiB (16 sequences, the reference's copy included)")
        assert moved > 0
        # 134.5M parameters: bf16 weights, fp32 master weights and Adam's two moments, the reference's bf16
        # copy (~2.4 GB together) plus activations of 16 short sequences; far more means a copy too many.
        assert peak < 6.0
    finally:
        _teardown()


def test_greedy_chat_answer_in_bfloat16_on_the_gpu_is_coherent_and_right(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16).cuda().eval()
    text = greedy_answer(model, AutoTokenizer.from_pretrained(smollm2_dir))  # the conversion's own check, on the GPU
    cpu_text = json.loads((smollm2_dir / MARKER).read_text())["greedy_text"]  # the float32 CPU answer
    print(f"bf16 greedy answer on the GPU: {text!r} (float32 on the CPU: {cpu_text!r}; equal: {text == cpu_text})")
    assert incoherence(text) is None, text
    assert "Paris" in text and "Paris" in cpu_text
