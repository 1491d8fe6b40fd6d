"""Prompt sharing (learner/sequences.py) on a GPU: CUDA kernels, SDPA and bfloat16.

Skipped where no GPU is visible (CI has none). The CPU tests (tests/unit/test_prompt_sharing.py) show
that a prompt's G rows sharing its forward pass give the log-probs and gradients of one pass per
sequence; here the same on CUDA, where attention runs other kernels (SDPA's memory-efficient and
flash backends, eager as the control) and where the learner trains in bfloat16. The shared layout puts
the prompt's pads between prompt and completion, the case the CPU tests could not put to a GPU
kernel. Models: Qwen2 and a Llama shaped like SmolLM2 (grouped-query attention, tied embeddings),
small and random, built here (no files). Needs torch and transformers only, so it runs on a bare
GPU image.

- float32 (TF32 off): shared and one-pass log-probs equal to 1e-4, gradients to 1e-4 (relative 1e-3);
- bfloat16: sharing adds no error of its own: its gap to the float32 one-pass log-probs is at most
  twice bfloat16's own gap (one pass per sequence in bfloat16), plus 1e-2.
"""
from __future__ import annotations

import pytest
import torch
from prompt_sharing_cases import groups, one_pass_logprobs
from small_models import llama_tied, qwen2

from learner.grpo import token_logprobs
from learner.sequences import pack_shared, shared_prompt_logits

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
              pytest.mark.usefixtures("no_tf32")]  # tests/e2e/conftest.py
CUDA = torch.device("cuda")


def shared_logprobs(model, prompt_ids, completion_ids):
    sp = pack_shared(prompt_ids, completion_ids)
    assert sp.saves_work()
    lp = token_logprobs(shared_prompt_logits(model, sp, CUDA), sp.completion_ids.to(CUDA))
    return lp, sp.completion_mask.to(CUDA).float()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("make", [qwen2, llama_tied], ids=["qwen2", "llama-tied"])
def test_float32_on_cuda_shared_equals_one_pass_log_probs_and_gradients(make, attn):
    model = make(attn).to(CUDA).train()
    prompt_ids, completion_ids = groups()
    shared, mask = shared_logprobs(model, prompt_ids, completion_ids)
    one = one_pass_logprobs(model, prompt_ids, completion_ids, device=CUDA)
    gap = (shared * mask - one * mask).abs().max().item()
    assert gap < 1e-4, gap
    weights = torch.linspace(-1, 1, mask.numel(), device=CUDA).reshape(mask.shape)
    params = [p for p in model.parameters() if p.requires_grad]
    g_shared = torch.autograd.grad((shared * mask * weights).sum(), params)
    g_one = torch.autograd.grad((one * mask * weights).sum(), params)
    for a, b in zip(g_shared, g_one):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-3), (a - b).abs().max().item()


@pytest.mark.parametrize("make", [qwen2, llama_tied], ids=["qwen2", "llama-tied"])
def test_bfloat16_sharing_adds_no_error_beyond_bfloat16s_own(make):
    model = make("sdpa").to(CUDA).eval()
    prompt_ids, completion_ids = groups(seed=3)
    with torch.no_grad():
        exact = one_pass_logprobs(model, prompt_ids, completion_ids, device=CUDA)  # float32
        model.to(torch.bfloat16)
        shared, mask = shared_logprobs(model, prompt_ids, completion_ids)
        one = one_pass_logprobs(model, prompt_ids, completion_ids, device=CUDA)
    own = ((one.float() - exact) * mask).abs().max().item()
    gap = ((shared.float() - exact) * mask).abs().max().item()
    assert torch.isfinite(shared).all()
    assert gap <= 2 * own + 1e-2, f"sharing's gap {gap} vs bfloat16's own {own}"
