"""Packed micro-batches (learner.pack_sequences): a micro-batch's sequences concatenated into one row, no padding.

Padded, a micro-batch of n sequences computes n x L token slots (L its longest sequence); packed, exactly the
sum of the lengths S. Each sequence's position ids restart at 0 and no attention mask is passed: transformers 5
(masking_utils `find_packed_sequence_indices`, used by `create_causal_mask` and its sliding-window twin) reads a
restart of the position ids as the start of a new sequence and builds the block-diagonal causal mask

    allowed(q, k) = k <= q and seq(q) == seq(k),   seq = cumsum(diff(position_ids) != 1)

for sdpa, eager and flex attention; flash-attention reads the same restarts as its varlen boundaries. So every
token attends to exactly the tokens it attends to padded, at the same positions: the same log-probs, to float
rounding (1e-5 in float32, tests/unit/test_packing.py). Models that build their mask another way (GPT-2's
absolute positions, models without `position_ids` in the mask) would let sequences see each other: packing
is refused for them at config time (learner/config.py PACKABLE_MODEL_TYPES, cluster/data/model_check.py).

Cost: sdpa and eager build the S x S mask and compute attention over it (S^2 against n L^2 padded); the linear
layers, most of a step, compute S slots against n L. flash-attention (varlen) pays neither.
"""
from __future__ import annotations

import torch

from learner.sequences import logits_to_keep


def packed_completion_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, comp_index: torch.Tensor,
                             device) -> torch.Tensor:
    """The right-padded micro-batch (input_ids, attention_mask [n, L]; comp_index [n, C], see learner/batch.py
    MicroBatch) through `model` as one packed row. Returns logits [n, C, V] laid out as the padded forward's:
    row (i, j) scores completion token j of sequence i (padding entries score some token of their sequence;
    their loss is masked out)."""
    lengths = attention_mask.sum(1)
    real = attention_mask.bool()
    flat_ids = input_ids[real].unsqueeze(0)  # right padding: each row's real tokens are its first `length`
    starts = torch.cumsum(lengths, 0) - lengths
    positions = torch.arange(int(lengths.max()), device=lengths.device).expand(len(lengths), -1)[real].unsqueeze(0)
    wanted = (starts.unsqueeze(1) + comp_index).to(device)  # [n, C] flat positions whose logits are read
    keep, at = torch.unique(wanted, return_inverse=True)  # the LM head scores these positions alone
    logits = model(input_ids=flat_ids.to(device), position_ids=positions.to(device), attention_mask=None,
                   use_cache=False, **logits_to_keep(model, keep)).logits[0]
    if logits.shape[0] != len(keep):  # a model that ignores logits_to_keep returned every position
        return logits[wanted]
    return logits[at]
