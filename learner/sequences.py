"""Padding (prompt, completion) pairs into a batch, and the log-probs of the completion tokens.

Pure torch + `learner.grpo.token_logprobs`, no Ray and no vLLM, so the reference actor and the
learner can compute log-probs the same way (same padding, same positions, same float32
log-softmax). Right padding keeps every real token at its own position and, with the attention
mask, away from the pads: a sequence's log-probs do not depend on what it is batched with (bit
for bit in one pass per sequence, as measured on CPU; to float rounding with prompt sharing,
where the padding after a shorter prompt moves its completion's keys within the cache).

Alignment: logits at position t predict token t+1, so with
`lp = token_logprobs(logits[:, :-1], input_ids[:, 1:])` the completion's log-probs are
`lp[completion_mask[:, 1:]]`.

Prompt sharing: the G completions of a GRPO group continue one prompt, so a micro-batch goes
through the model in two passes: its distinct prompts once (`pack_shared`), then every
completion attending to its prompt's keys and values, copied from that pass into a KV cache
(`shared_prompt_logits`). The same attention over the same tokens at the same positions, so the
log-probs and gradients are those of one pass per sequence (to float rounding; tested), and the
prompt tokens cost 1/G of the compute. Short completions after long prompts gain the most.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

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


class PromptSharingUnsupported(RuntimeError):
    """The model's KV cache is not one plain key/value tensor pair per layer (e.g. sliding-window
    layers): its prompts cannot be shared this way; use one pass per sequence."""


@dataclass
class SharedPrompts:
    """A micro-batch of n (prompt, completion) rows laid out for prompt sharing: its u distinct
    prompts, right-padded [u, P], and the completions, right-padded [n, C]."""

    prompt_ids: torch.Tensor  # [u, P] long
    prompt_mask: torch.Tensor  # [u, P] long, 1 on real tokens
    prompt_last: torch.Tensor  # [u] position of each prompt's last token
    row_prompt: torch.Tensor  # [n] the prompt each row continues
    completion_ids: torch.Tensor  # [n, C] long, pad_id after each completion
    completion_mask: torch.Tensor  # [n, C] long, 1 on real tokens
    completion_pos: torch.Tensor  # [n, C] position ids: prompt length + j
    one_pass_width: int  # the longest prompt + completion: one pass per sequence pads the rows to it

    def saves_work(self) -> bool:
        """Whether the two passes hold fewer token slots (padding included) than one pass per sequence."""
        (u, P), (n, C) = self.prompt_ids.shape, self.completion_ids.shape
        return shared_slots(u, P, n, C) < n * self.one_pass_width


def shared_slots(num_prompts: int, prompt_width: int, num_rows: int, completion_width: int) -> int:
    """Token slots of prompt sharing's two passes: the distinct prompts, then every row's completion
    (padded to at least one slot: the first completion token is scored from the prompt pass)."""
    return num_prompts * prompt_width + num_rows * max(completion_width, 1)


def pack_shared(prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int = 0) -> SharedPrompts:
    """The rows' distinct prompts (in order of first appearance) and their completions."""
    index: dict[tuple, int] = {}
    row_prompt = [index.setdefault(tuple(p), len(index)) for p in prompt_ids]
    prompts = list(index)
    P, C = max(map(len, prompts)), max(max(map(len, completion_ids)), 1)
    return SharedPrompts(
        prompt_ids=torch.tensor([list(p) + [pad_id] * (P - len(p)) for p in prompts], dtype=torch.long),
        prompt_mask=torch.tensor([[1] * len(p) + [0] * (P - len(p)) for p in prompts], dtype=torch.long),
        prompt_last=torch.tensor([len(p) - 1 for p in prompts], dtype=torch.long),
        row_prompt=torch.tensor(row_prompt, dtype=torch.long),
        completion_ids=torch.tensor([list(c) + [pad_id] * (C - len(c)) for c in completion_ids], dtype=torch.long),
        completion_mask=torch.tensor([[1] * len(c) + [0] * (C - len(c)) for c in completion_ids], dtype=torch.long),
        completion_pos=torch.tensor([list(range(len(p), len(p) + C)) for p in prompt_ids], dtype=torch.long),
        one_pass_width=max(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)))


def logits_to_keep(model, keep: int | torch.Tensor) -> dict:
    """The forward's keyword that has the LM head score only the last `keep` positions (or the positions
    listed), where the model under `model` (DeepSpeed's engine, a peft wrapper) takes it, as transformers'
    causal LMs do (TRL passes it too): the logits of positions never read are a good share of the step
    for a large vocabulary and the step's largest tensor ([n, T, V]). Empty where it is not taken; the
    caller reads which positions came back from the logits' width."""
    inner = getattr(model, "module", model)
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    return {"logits_to_keep": keep} if "logits_to_keep" in inspect.signature(inner.forward).parameters else {}


def shared_prompt_logits(model, sp: SharedPrompts, device) -> torch.Tensor:
    """[n, C, V] logits, row j scoring completion token j, with each distinct prompt through `model`
    (a HF causal LM, or DeepSpeed's engine around one) once. Differentiable: the gradient of a
    prompt's keys and values sums over the rows that attend to them, as in one pass per sequence.

    Pass 1 runs the prompts with a KV cache. Pass 2 runs the completions with that cache, each row
    given its prompt's keys and values: in the cache a row's slots are its prompt (right-padded,
    the pads masked out) then its completion, so causal attention sees exactly the tokens before
    each one; the position ids continue from the prompt's real length."""
    from transformers import DynamicCache

    rows = sp.row_prompt.to(device)
    prompt_mask = sp.prompt_mask.to(device)
    positions = torch.arange(sp.prompt_ids.shape[1], device=device).expand(sp.prompt_ids.shape[0], -1)
    # Of the prompt pass only each prompt's last position is scored: the LM head runs on those alone.
    last_positions, column = torch.unique(sp.prompt_last.to(device), return_inverse=True)
    out = model(input_ids=sp.prompt_ids.to(device), attention_mask=prompt_mask, position_ids=positions,
                use_cache=True, **logits_to_keep(model, last_positions))
    layers = getattr(out.past_key_values, "layers", None)
    if not layers or any(type(layer).__name__ != "DynamicLayer" for layer in layers):
        raise PromptSharingUnsupported(f"the model's cache is {type(out.past_key_values).__name__} with layers "
                                       f"{sorted({type(layer).__name__ for layer in layers or []})}")
    cache = DynamicCache([(layer.keys.index_select(0, rows), layer.values.index_select(0, rows)) for layer in layers])
    logits = model(input_ids=sp.completion_ids.to(device),
                   attention_mask=torch.cat([prompt_mask.index_select(0, rows), sp.completion_mask.to(device)], 1),
                   position_ids=sp.completion_pos.to(device), past_key_values=cache, use_cache=True).logits
    kept = out.logits.shape[1] == len(last_positions) < sp.prompt_ids.shape[1]  # else every position came back
    last = out.logits[torch.arange(len(sp.prompt_last), device=device), column if kept else sp.prompt_last.to(device)]
    return torch.cat([last.index_select(0, rows).unsqueeze(1), logits[:, :-1]], 1)


def slots(prompt_ids: list[list[int]], completion_ids: list[list[int]], rows: list[int], share: bool) -> int:
    """Token slots (padding included) the forward of micro-batch `rows` computes: one pass per
    sequence, or with `share` the cheaper of that and the two passes of prompt sharing."""
    one_pass = len(rows) * max(len(prompt_ids[i]) + len(completion_ids[i]) for i in rows)
    if not share:
        return one_pass
    prompts = {tuple(prompt_ids[i]) for i in rows}
    return min(one_pass, shared_slots(len(prompts), max(map(len, prompts)), len(rows),
                                      max(len(completion_ids[i]) for i in rows)))


def micro_batch_order(prompt_ids: list[list[int]], completion_ids: list[list[int]], size: int,
                      share: bool) -> list[int]:
    """The row order whose micro-batches of `size` hold the fewest token slots: sequences by length
    (little padding), or with `share` also a prompt's rows together (one prompt pass per group, the
    completions padded to the group's longest) or completions by length (rows of one prompt still
    share it where they meet). Which wins depends on the lengths: measured here, not assumed."""
    n = len(prompt_ids)
    candidates = [sorted(range(n), key=lambda i: len(prompt_ids[i]) + len(completion_ids[i]))]
    if share:
        candidates.append(sorted(range(n), key=lambda i: (len(prompt_ids[i]), prompt_ids[i], len(completion_ids[i]))))
        candidates.append(sorted(range(n), key=lambda i: (len(completion_ids[i]), len(prompt_ids[i]), prompt_ids[i])))
    return min(candidates, key=lambda order: sum(slots(prompt_ids, completion_ids, order[s:s + size], share)
                                                  for s in range(0, n, size)))


def completion_logprobs(model, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                        micro_batch_size: int, pad_id: int = 0, share_prompts: bool = True) -> list[list[float]]:
    """log p(completion token | everything before it) under `model` (a HF causal LM), one list
    per sequence, computed `micro_batch_size` sequences per forward. Runs without autograd.
    `share_prompts`: the rows of one prompt share its forward pass (see the module docstring);
    a model whose cache does not allow it falls back to one pass per sequence."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    device = next(model.parameters()).device
    # Sequences of about one length (and of one prompt) share a forward; the results go back in order.
    order = micro_batch_order(prompt_ids, completion_ids, micro_batch_size, share_prompts)
    out: list[list[float]] = [[] for _ in order]
    with torch.no_grad():
        for start in range(0, len(order), micro_batch_size):
            rows = order[start:start + micro_batch_size]
            if share_prompts:
                sp = pack_shared([prompt_ids[i] for i in rows], [completion_ids[i] for i in rows], pad_id)
                if sp.saves_work():
                    try:
                        lp = token_logprobs(shared_prompt_logits(model, sp, device), sp.completion_ids.to(device))
                    except PromptSharingUnsupported:
                        share_prompts = False
                    else:
                        for r, i in enumerate(rows):
                            out[i] = lp[r, :len(completion_ids[i])].tolist()
                        continue
            ids, mask, pos, comp = pack_sequences([prompt_ids[i] for i in rows], [completion_ids[i] for i in rows], pad_id)
            width = ids.shape[1]  # logits from the first completion position on (row t scores token t+1)
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=pos.to(device),
                           **logits_to_keep(model, width - min(len(prompt_ids[i]) for i in rows) + 1)).logits
            # Only the completion positions go through the log-softmax.
            keep = comp[:, 1:][:, width - logits.shape[1]:].to(device)
            # [K, 1, V]: the chunks of token_logprobs then bound the float32 copy (a row per token).
            targets = ids[:, 1:][:, width - logits.shape[1]:].to(device)
            lp = token_logprobs(logits[:, :-1][keep].unsqueeze(1), targets[keep].unsqueeze(1))[:, 0]
            for i, row in zip(rows, lp.cpu().split(keep.sum(1).tolist())):
                out[i] = row.tolist()
    return out
