"""Prompt sharing (learner/sequences.py): the rows of one prompt share its forward pass. Log-probs and
gradients must be those of one pass per sequence, on more than one architecture; a model whose cache
cannot be shared falls back. Small random models, built here (no files)."""
from __future__ import annotations

import pytest
import torch
from prompt_sharing_cases import groups, one_pass_logprobs

from learner.batch import MicroBatch, TrainBatch
from learner.forward import completion_logits
from learner.grpo import token_logprobs
from learner.sequences import PromptSharingUnsupported, completion_logprobs, pack_shared, shared_prompt_logits


def qwen2(**kw):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                                        intermediate_size=128, vocab_size=96, **kw))


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=96, n_positions=64, bos_token_id=1,
                                      eos_token_id=1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


@pytest.mark.parametrize("make", [qwen2, gpt2], ids=["qwen2", "gpt2"])
def test_shared_prompts_give_the_log_probs_and_gradients_of_one_pass_per_sequence(make):
    model = make()
    model.train()  # as the learner runs it (dropout 0 in these configs)
    prompt_ids, completion_ids = groups()
    sp = pack_shared(prompt_ids, completion_ids)
    assert sp.prompt_ids.shape[0] == 3 and sp.saves_work()
    shared = token_logprobs(shared_prompt_logits(model, sp, torch.device("cpu")), sp.completion_ids)
    mask = sp.completion_mask.float()
    one = one_pass_logprobs(model, prompt_ids, completion_ids)
    assert torch.allclose(shared * mask, one * mask, atol=1e-5), (shared * mask - one * mask).abs().max()
    weights = torch.linspace(-1, 1, mask.numel()).reshape(mask.shape)  # a loss that weighs every token differently
    params = [p for p in model.parameters() if p.requires_grad]
    g_shared = torch.autograd.grad((shared * mask * weights).sum(), params)
    g_one = torch.autograd.grad((one * mask * weights).sum(), params)
    for a, b in zip(g_shared, g_one):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), (a - b).abs().max()


def test_the_reference_path_shares_prompts_and_returns_rows_in_order():
    model = qwen2().eval()
    prompt_ids, completion_ids = groups(seed=1)
    shared = completion_logprobs(model, prompt_ids, completion_ids, micro_batch_size=5)
    one = completion_logprobs(model, prompt_ids, completion_ids, micro_batch_size=5, share_prompts=False)
    assert [len(r) for r in shared] == [len(c) for c in completion_ids]
    for a, b in zip(shared, one):
        assert a == pytest.approx(b, abs=1e-5)


def test_a_cache_that_cannot_be_shared_falls_back_to_one_pass_per_sequence():
    """Sliding-window layers keep a cache of another kind: sharing refuses it, and the reference path
    then gives the one-pass log-probs."""
    model = qwen2(use_sliding_window=True, sliding_window=4, max_window_layers=0).eval()
    prompt_ids, completion_ids = groups(seed=2)
    with pytest.raises(PromptSharingUnsupported, match="cache"):
        shared_prompt_logits(model, pack_shared(prompt_ids, completion_ids), torch.device("cpu"))
    got = completion_logprobs(model, prompt_ids, completion_ids, micro_batch_size=8)
    one = completion_logprobs(model, prompt_ids, completion_ids, micro_batch_size=8, share_prompts=False)
    assert all(a == pytest.approx(b, abs=1e-6) for a, b in zip(got, one))


@pytest.mark.parametrize("make", [qwen2, gpt2], ids=["qwen2", "gpt2"])
def test_the_lm_head_scores_only_the_positions_whose_log_probs_are_read(make):
    """transformers' `logits_to_keep`: one pass per sequence scores from the first completion position on,
    the prompt pass of prompt sharing only each prompt's last position; the log-probs and the gradients
    are those of scoring every position."""
    model = make()
    model.train()
    scored = []
    model.lm_head.register_forward_hook(lambda m, args, out: scored.append(args[0].shape[0] * args[0].shape[1]))
    prompt_ids, completion_ids = groups()
    n = len(prompt_ids)
    mb = MicroBatch.build(TrainBatch(prompt_ids, completion_ids, [0.0] * n, [[0.0] * len(c) for c in completion_ids]),
                          range(n))
    mask = mb.mask
    one = one_pass_logprobs(model, prompt_ids, completion_ids)
    params = [p for p in model.parameters() if p.requires_grad]
    weights = torch.linspace(-1, 1, mask.numel()).reshape(mask.shape)
    g_one = torch.autograd.grad((one * mask * weights).sum(), params)
    width, shortest_prompt = mb.input_ids.shape[1], min(map(len, prompt_ids))
    for share in (False, True):
        scored.clear()
        logits, targets = completion_logits(model, mb, torch.device("cpu"), share)
        lp = token_logprobs(logits, targets)
        if share:  # the prompt pass: the 3 prompts' last positions (lengths 5, 2 and 8); then every completion row
            assert scored[0] == 3 * 3 and scored[1] == n * mb.shared.completion_ids.shape[1], scored
        else:
            assert scored == [n * (width - shortest_prompt + 1)] and scored[0] < n * width
        assert torch.allclose(lp * mask, one * mask, atol=1e-5), (lp * mask - one * mask).abs().max()
        for a, b in zip(torch.autograd.grad((lp * mask * weights).sum(), params), g_one):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), (a - b).abs().max()
    scored.clear()
    plain = completion_logprobs(model.eval(), prompt_ids, completion_ids, micro_batch_size=n, share_prompts=False)
    assert scored == [n * (width - shortest_prompt + 1)]
    for row, c, ref in zip(plain, completion_ids, one):
        assert row == pytest.approx(ref[:len(c)].tolist(), abs=1e-5)
