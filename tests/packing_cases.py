"""The micro-batch the packing tests compare packed and right-padded forwards on (CPU: tests/unit/
test_packing.py; GPU: tests/e2e/test_packing_gpu.py)."""
from __future__ import annotations

import torch

from learner.batch import TrainBatch

# Lengths that leave much padding right-padded: prompts of 3..11 tokens, completions of 1..17
PROMPTS = [[5, 6, 7], [8] * 11, [9, 10, 11, 12, 13], [14, 15, 16, 17, 18, 19, 20]]
COMPLETIONS = [[21] * 17, [22], [23, 24, 25, 26, 27, 28], [29, 30, 31, 32, 33, 34, 35, 36, 37]]


def micro_batch(vocab: int):
    """PROMPTS and COMPLETIONS' lengths with random token ids below `vocab`, as one micro-batch."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (len(p),), generator=g).tolist() for p in PROMPTS]
    completions = [torch.randint(3, vocab, (len(c),), generator=g).tolist() for c in COMPLETIONS]
    batch = TrainBatch(prompt_ids=prompts, completion_ids=completions, advantages=[1.0, -1.0, 0.5, -0.5],
                       behavior_logp=[[0.0] * len(c) for c in completions], pad_id=0)
    (mb,) = batch.micro_batches(size=len(PROMPTS))
    return mb
