"""Packed micro-batches (learner.pack_sequences, learner/packing.py): the completion log-probs and their gradients
equal the right-padded forward's to 1e-5 in float32, on a tiny Qwen2 and a tiny Llama; a model kind whose mask is
not built from position ids is refused at config time, naming the key."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from packing_cases import COMPLETIONS, micro_batch

from cluster.data.model_check import packing_problems
from learner.config import LearnerConfig
from learner.forward import completion_logits, logprobs_and_entropy
from learner.worker import LearnerWorker


def qwen2(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # SmolLM2's architecture, tiny and random
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=True)).float()


def logprobs_and_grads(model, mb, pack: bool):
    model.zero_grad()
    logits, targets = completion_logits(model, mb, "cpu", share_prompts=False, pack=pack)
    logp, _ = logprobs_and_entropy(logits, targets, with_entropy=False)
    (logp * mb.mask).sum().backward()
    return logp.detach() * mb.mask, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_packed_log_probs_and_gradients_equal_the_padded_ones(kind, tiny_model_dir):
    model = qwen2(tiny_model_dir) if kind == "qwen2" else llama()
    mb = micro_batch(model.config.vocab_size)
    padded, padded_grads = logprobs_and_grads(model, mb, pack=False)
    packed, packed_grads = logprobs_and_grads(model, mb, pack=True)
    assert mb.mask.sum() == sum(map(len, COMPLETIONS)) and (padded != 0).sum() >= mb.mask.sum() - 1
    assert (packed - padded).abs().max().item() <= 1e-5
    assert padded_grads.keys() == packed_grads.keys() and padded_grads
    scale = max(g.abs().max().item() for g in padded_grads.values())
    assert max((packed_grads[k] - g).abs().max().item() for k, g in padded_grads.items()) <= 1e-5 * max(1.0, scale)


def test_packing_keeps_sequences_apart():
    """Without the restarting position ids the sequences would see each other: the check above can fail."""
    model = llama()
    mb = micro_batch(model.config.vocab_size)
    padded, _ = logprobs_and_grads(model, mb, pack=False)
    one_sequence = mb.attention_mask.clone()
    lengths = one_sequence.sum(1)
    flat = mb.input_ids[one_sequence.bool()].unsqueeze(0)
    with torch.no_grad():  # one long sequence, positions 0..S-1: later sequences attend to earlier ones
        logits = model(input_ids=flat, position_ids=torch.arange(flat.shape[1]).unsqueeze(0)).logits[0]
    starts = torch.cumsum(lengths, 0) - lengths
    last = 3  # the last sequence's log-probs differ once it sees the three before it
    seen = torch.log_softmax(logits[starts[last] + mb.comp_index[last]], -1).gather(
        1, mb.input_ids[last, 1:].gather(0, mb.comp_index[last]).unsqueeze(1))[:, 0]
    assert (seen * mb.mask[last] - padded[last]).abs().max().item() > 1e-3


def test_a_model_kind_packing_cannot_keep_apart_is_refused_naming_the_key(tmp_path, tiny_model_dir):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (text,) = packing_problems(tmp_path)
    assert text.startswith("learner.pack_sequences is not supported for model_type 'gpt2'")
    assert "learner.pack_sequences=false" in text
    assert packing_problems(tiny_model_dir) == []  # qwen2


class RecordingModel(torch.nn.Module):
    """The learner's model, recording what each forward was given."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, []

    def forward(self, **kwargs):
        self.calls.append(kwargs)
        return self.inner(**kwargs)


@pytest.mark.parametrize("pack", [False, True])
def test_a_learner_rank_packs_its_micro_batches_when_configured(pack):
    """LearnerWorker's forward (no DeepSpeed: the rank's state stood in for) takes learner.pack_sequences."""
    model = RecordingModel(llama())
    rank = SimpleNamespace(cfg=LearnerConfig(pack_sequences=pack), share_prompts=False, device="cpu", engine=model)
    mb = micro_batch(256)
    LearnerWorker._forward(rank, mb, with_entropy=False)
    (call,) = model.calls
    assert (call["attention_mask"] is None, call["input_ids"].shape[0]) == ((True, 1) if pack else (False, 4))
    assert ("one row per micro-batch (packed" in LearnerWorker._forward_kind(rank)) == pack
