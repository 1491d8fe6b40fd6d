"""Padding (prompt, completion) pairs into a batch, and the log-probs of the completion tokens.

Pure torch + `learner.grpo.token_logprobs`, no Ray and no vLLM, so the reference actor and the
learner can compute log-probs the same way (same padding, same positions, same float32
log-softmax). Right padding keeps every real token at its own position and, with the attention
mask, away from the pads: a sequence's log-probs do not depend on what it is batched with.

Alignment: logits at position t predict token t+1, so with
`lp = token_logprobs(logits[:, :-1], input_ids[:, 1:])` the completion's log-probs are
`lp[completion_mask[:, 1:]]`.
"""
from __future__ import annotations

import torch

from learner.grpo import token_logprobs


def pack_sequences(prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int = 0):
    """Right-padded batch of prompt + completion.

    Returns (all [N, T], T = the longest prompt + completion):
      input_ids       long, pad_id after each sequence's end
      attention_mask  long, 1 on real tokens
      position_ids    long, 0..len-1 on real tokens (0 on pads)
      completion_mask bool, True on completion tokens
    """
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
    lengths = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)]
    width = max(lengths, default=0)
    # Padded Python lists, one tensor each at the end (a tensor per row costs more than the
    # forward pass of a small model).
    ids, attn, pos, comp = [], [], [], []
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        if not p:
            raise ValueError(f"sequence {i} has an empty prompt: the first completion token needs a context")
        length, pad = lengths[i], width - lengths[i]
        ids.append(list(p) + list(c) + [pad_id] * pad)
        attn.append([1] * length + [0] * pad)
        pos.append(list(range(length)) + [0] * pad)
        comp.append([False] * len(p) + [True] * len(c) + [False] * pad)
    shape = (len(ids), width)
    input_ids = torch.tensor(ids, dtype=torch.long).reshape(shape)
    attention_mask = torch.tensor(attn, dtype=torch.long).reshape(shape)
    position_ids = torch.tensor(pos, dtype=torch.long).reshape(shape)
    completion_mask = torch.tensor(comp, dtype=torch.bool).reshape(shape)
    return input_ids, attention_mask, position_ids, completion_mask


def completion_logprobs(model, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                        micro_batch_size: int, pad_id: int = 0) -> list[list[float]]:
    """log p(completion token | everything before it) under `model` (a HF causal LM), one list
    per sequence, computed `micro_batch_size` sequences per forward. Runs without autograd."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    device = next(model.parameters()).device
    # Sequences of about one length share a forward (less padding); the results go back in order.
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]) + len(completion_ids[i]))
    out: list[list[float]] = [[] for _ in order]
    with torch.no_grad():
        for start in range(0, len(order), micro_batch_size):
            rows = order[start:start + micro_batch_size]
            ids, mask, pos, comp = pack_sequences([prompt_ids[i] for i in rows], [completion_ids[i] for i in rows], pad_id)
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device),
                           position_ids=pos.to(device)).logits
            # Only the completion positions go through the log-softmax (row t scores token t+1).
            keep = comp[:, 1:].to(device)
            # [K, 1, V]: the chunks of token_logprobs then bound the float32 copy (a row per token).
            lp = token_logprobs(logits[:, :-1][keep].unsqueeze(1), ids[:, 1:].to(device)[keep].unsqueeze(1))[:, 0]
            for i, row in zip(rows, lp.cpu().split(keep.sum(1).tolist())):
                out[i] = row.tolist()
    return out
