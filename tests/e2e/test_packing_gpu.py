"""Packed micro-batches (learner.pack_sequences, learner/packing.py) on a GPU: CUDA's attention kernels and bfloat16.

Skipped where no GPU is visible (CI has none). On a CPU (tests/unit/test_packing.py) the packed row gives the
right-padded forward's log-probs and gradients to 1e-5; there transformers builds the block-diagonal mask from
the restarting position ids and hands it to the CPU's SDPA. On CUDA an explicit mask sends SDPA to other
kernels (memory-efficient attention rather than flash), and the learner trains in bfloat16. Models: small
random Qwen2 and a SmolLM2-shaped Llama (tests/e2e/small_models.py), built here; torch and transformers only, so
a bare GPU image will do. Through the learner itself: tests/e2e/test_learner_gpu.py (a packed float32 step
equals plain torch's).

- float32 (TF32 off), SDPA and eager: packed and padded log-probs equal to 1e-4, gradients to 1e-4 (relative 1e-3);
- bfloat16: packing adds no error of its own: its gap to the float32 padded log-probs is at most twice
  bfloat16's own gap (the padded forward in bfloat16), plus 1e-2.
"""
from __future__ import annotations

import pytest
import torch
from packing_cases import micro_batch
from small_models import VOCAB, llama_tied, qwen2

from learner.forward import completion_logits, logprobs_and_entropy

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
              pytest.mark.usefixtures("no_tf32")]  # tests/e2e/conftest.py
CUDA = torch.device("cuda")


def completion_logprobs(model, mb, pack: bool) -> torch.Tensor:
    """log pi of every completion token [n, C] on CUDA, padding entries zeroed."""
    logits, targets = completion_logits(model, mb, CUDA, share_prompts=False, pack=pack)
    logp, _ = logprobs_and_entropy(logits, targets, with_entropy=False)
    return logp * mb.mask.to(CUDA)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("make", [qwen2, llama_tied], ids=["qwen2", "llama-tied"])
def test_float32_on_cuda_packed_equals_padded_log_probs_and_gradients(make, attn):
    model = make(attn).to(CUDA).train()
    mb = micro_batch(VOCAB)
    padded, packed = completion_logprobs(model, mb, pack=False), completion_logprobs(model, mb, pack=True)
    assert (padded != 0).sum().item() >= mb.mask.sum().item() - 1  # the comparison covers the real tokens
    gap = (packed - padded).abs().max().item()
    assert gap < 1e-4, gap
    weights = torch.linspace(-1, 1, padded.numel(), device=CUDA).reshape(padded.shape)
    params = [p for p in model.parameters() if p.requires_grad]
    g_padded = torch.autograd.grad((padded * weights).sum(), params)
    g_packed = torch.autograd.grad((packed * weights).sum(), params)
    for a, b in zip(g_packed, g_padded):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-3), (a - b).abs().max().item()


@pytest.mark.parametrize("make", [qwen2, llama_tied], ids=["qwen2", "llama-tied"])
def test_bfloat16_packing_adds_no_error_beyond_bfloat16s_own(make):
    model = make("sdpa").to(CUDA).eval()
    mb = micro_batch(VOCAB)
    with torch.no_grad():
        exact = completion_logprobs(model, mb, pack=False)  # float32
        model.to(torch.bfloat16)
        packed = completion_logprobs(model, mb, pack=True).float()
        padded = completion_logprobs(model, mb, pack=False).float()
    own, gap = (padded - exact).abs().max().item(), (packed - exact).abs().max().item()
    assert torch.isfinite(packed).all()
    assert gap <= 2 * own + 1e-2, f"packing's gap {gap} vs bfloat16's own {own}"
