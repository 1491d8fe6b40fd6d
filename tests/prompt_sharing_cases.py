"""The rows and the one-pass reference the prompt-sharing tests compare against (CPU: tests/unit/
test_prompt_sharing.py; GPU: tests/e2e/test_prompt_sharing_gpu.py)."""
from __future__ import annotations

import random

import torch

from learner.grpo import token_logprobs
from learner.sequences import pack_sequences


def groups(seed=0, prompts=3, G=4):
    """G rows per prompt, prompts of different lengths, completions of different lengths."""
    g = random.Random(seed)
    ps = [[g.randrange(1, 96) for _ in range(n)] for n in (5, 2, 8)[:prompts]]
    rows = [(p, [g.randrange(1, 96) for _ in range(g.choice([1, 2, 4, 6]))]) for p in ps for _ in range(G)]
    g.shuffle(rows)
    return [p for p, _ in rows], [c for _, c in rows]


def one_pass_logprobs(model, prompt_ids, completion_ids, device: torch.device | None = None):
    """The reference: one forward pass per sequence (right-padded), [n, C] like the shared layout."""
    ids, mask, pos, comp = (t.to(device or "cpu") for t in pack_sequences(prompt_ids, completion_ids))
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits[:, :-1]
    lp = token_logprobs(logits, ids[:, 1:])
    C = max(map(len, completion_ids))
    return torch.stack([torch.cat([lp[i][comp[i, 1:]], lp.new_zeros(C - len(c))]) for i, c in enumerate(completion_ids)])
