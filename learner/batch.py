"""The learner's input: one GRPO batch, and how a rank cuts it into padded micro-batches.

Kept free of DeepSpeed and Ray so the padding / masking / sharding rules can be read
(and tested) on their own. Everything here is plain lists on the wire (cheap to send
through Ray, no pickled tensors) and torch tensors once on a rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from learner.sequences import SharedPrompts, micro_batch_order, pack_shared


@dataclass
class TrainBatch:
    """N completions with everything the loss needs, prompt-major (the G samples of a prompt adjacent).

    prompt_ids[i] + completion_ids[i] is sequence i. The per-token lists
    (behavior_logp, ref_logp, loss_mask) have exactly len(completion_ids[i]) entries each.

    Multi-turn trajectories: completion_ids holds everything after the first prompt, the model's
    turns and the environment's messages between them; loss_mask is 1 on the model's tokens and
    0 on the environment's. Environment tokens are context only: out of the loss, the KL, every
    token count and every metric; the per-token values there (behavior_logp, ref_logp) are never
    read (they may be NaN). None: every completion token is the model's.
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    advantages: list[float]
    behavior_logp: list[list[float]]  # vLLM's log-probs of the sampled tokens (for TIS)
    ref_logp: list[list[float]] | None = None  # reference model's log-probs (needed when beta > 0)
    pad_id: int = 0
    # The sampler's cap on completion length (rollout.max_new_tokens): Dr. GRPO's constant
    # normaliser for aggregation "seq-mean-token-sum-norm". None: the longest completion here.
    max_new_tokens: int | None = None
    loss_mask: list[list[int]] | None = None

    def __len__(self) -> int:
        return len(self.completion_ids)

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistency (lengths that do not line up)."""
        n = len(self.completion_ids)
        if n == 0:
            raise ValueError("TrainBatch is empty")
        for name in ("prompt_ids", "advantages", "behavior_logp"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"TrainBatch.{name} has {len(getattr(self, name))} entries, completion_ids has {n}")
        for name in ("ref_logp", "loss_mask"):
            if getattr(self, name) is not None and len(getattr(self, name)) != n:
                raise ValueError(f"TrainBatch.{name} has {len(getattr(self, name))} entries, completion_ids has {n}")
        for i, (p, c) in enumerate(zip(self.prompt_ids, self.completion_ids)):
            if not p:
                raise ValueError(f"sequence {i} has an empty prompt (the first completion token needs a context)")
            if len(self.behavior_logp[i]) != len(c):
                raise ValueError(f"sequence {i}: {len(c)} completion tokens but {len(self.behavior_logp[i])} behavior_logp")
            if self.ref_logp is not None and len(self.ref_logp[i]) != len(c):
                raise ValueError(f"sequence {i}: {len(c)} completion tokens but {len(self.ref_logp[i])} ref_logp")
            if self.loss_mask is not None and len(self.loss_mask[i]) != len(c):
                raise ValueError(f"sequence {i}: {len(c)} completion tokens but {len(self.loss_mask[i])} loss_mask")

    def sequence_mask(self, i: int) -> list[int]:
        """1 on sequence i's completion tokens that are trained on (the model's), 0 on the rest."""
        return [1] * len(self.completion_ids[i]) if self.loss_mask is None else [int(bool(v)) for v in self.loss_mask[i]]

    def num_completion_tokens(self) -> int:
        """Tokens the loss is taken over: the model's (environment tokens do not count)."""
        if self.loss_mask is None:
            return sum(len(c) for c in self.completion_ids)
        return sum(int(bool(v)) for row in self.loss_mask for v in row)

    def num_trained_sequences(self) -> int:
        """Sequences with at least one trained token: N of the seq-mean aggregations. A sequence whose
        mask is all 0 (an unscorable sample, left out of the loss) does not count."""
        if self.loss_mask is None:
            return len(self)
        return sum(any(row) for row in self.loss_mask)

    def max_trained_tokens(self) -> int:
        """The most model tokens in one sequence (Dr. GRPO's fallback normaliser)."""
        return max(sum(self.sequence_mask(i)) for i in range(len(self)))

    def norm_length(self) -> int:
        """Dr. GRPO's constant length normaliser (aggregation seq-mean-token-sum-norm): the sampler's
        cap, or without one the most model tokens in one sequence here."""
        return self.max_new_tokens or max(1, self.max_trained_tokens())

    def shard(self, rank: int, world_size: int) -> TrainBatch:
        """Rank `rank`'s contiguous 1/world_size of the sequences (every rank gets the same count)."""
        n = len(self)
        if n % world_size:
            raise ValueError(
                f"the batch has {n} sequences, which does not split evenly over {world_size} learner ranks; "
                f"make prompts_per_step * group_size a multiple of learner.num_ranks")
        k = n // world_size
        sl = slice(rank * k, (rank + 1) * k)
        return TrainBatch(
            prompt_ids=self.prompt_ids[sl], completion_ids=self.completion_ids[sl],
            advantages=self.advantages[sl], behavior_logp=self.behavior_logp[sl],
            ref_logp=None if self.ref_logp is None else self.ref_logp[sl], pad_id=self.pad_id,
            max_new_tokens=self.max_new_tokens, loss_mask=None if self.loss_mask is None else self.loss_mask[sl])

    def micro_batches(self, size: int, by_length: bool = False, share_prompts: bool = False) -> list[MicroBatch]:
        """Chunks of at most `size` sequences, each padded to its own longest sequence: consecutive
        ones, or with `by_length` in the order that computes the fewest token slots (sequences of
        about one length together; with `share_prompts`, for prompt sharing: learner/sequences.py
        micro_batch_order). The loss of a batch is a sum over its micro-batches, so which sequences
        share one changes only the order of float additions."""
        order = micro_batch_order(self.prompt_ids, self.completion_ids, size, share_prompts) if by_length \
            else list(range(len(self)))
        return [MicroBatch.build(self, order[s:s + size]) for s in range(0, len(self), size)]


@dataclass
class MicroBatch:
    """Right-padded tensors for one forward pass.

    input_ids/attention_mask/position_ids: [n, L]   (L = longest prompt+completion here)
    comp_index: [n, C] position in the log-prob row [n, L-1] of each completion token
               (log-prob row t scores token t+1, so completion token j of a sequence with
               prompt length P sits at P - 1 + j); C = longest completion here
    mask:       [n, C] 1 on completion tokens trained on (not padding, not environment tokens)
    advantages: [n]; behavior_logp/ref_logp: [n, C] (0 on padding)
    shared:     the same rows laid out for prompt sharing (learner/sequences.py): its distinct
                prompts once, then the completions, whose [n, C] line up with the fields above
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    comp_index: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    behavior_logp: torch.Tensor
    ref_logp: torch.Tensor | None
    shared: SharedPrompts

    @staticmethod
    def build(batch: TrainBatch, rows) -> MicroBatch:
        # Padded Python lists first, one tensor each at the end: a tensor per row and field costs
        # ~8 ms per 256 sequences, a fair share of a small model's step.
        rows = list(rows)
        seqs = [batch.prompt_ids[i] + batch.completion_ids[i] for i in rows]
        n, L = len(rows), max(len(s) for s in seqs)
        C = max(max(len(batch.completion_ids[i]) for i in rows), 1)
        ids, attn, index, keep_rows, beh_rows, ref_rows = [], [], [], [], [], []
        for r, i in enumerate(rows):
            p, c = len(batch.prompt_ids[i]), len(batch.completion_ids[i])
            ids.append(list(seqs[r]) + [batch.pad_id] * (L - p - c))
            attn.append([1] * (p + c) + [0] * (L - p - c))
            index.append(list(range(p - 1, p - 1 + c)) + [0] * (C - c))
            keep = batch.sequence_mask(i)
            keep_rows.append(keep + [0] * (C - c))
            # Values at environment positions are never read: zero them so nothing non-finite travels on.
            beh_rows.append([v if k else 0.0 for v, k in zip(batch.behavior_logp[i], keep)] + [0.0] * (C - c))
            if batch.ref_logp is not None:
                ref_rows.append([v if k else 0.0 for v, k in zip(batch.ref_logp[i], keep)] + [0.0] * (C - c))
        input_ids = torch.tensor(ids, dtype=torch.long)
        attention_mask = torch.tensor(attn, dtype=torch.long)
        comp_index = torch.tensor(index, dtype=torch.long)
        mask = torch.tensor(keep_rows, dtype=torch.float32)
        beh = torch.tensor(beh_rows, dtype=torch.float32)
        ref = None if batch.ref_logp is None else torch.tensor(ref_rows, dtype=torch.float32)
        # Right padding: positions count from 0 at the first token of every row; the padded
        # tail never influences real tokens (causal attention + the key mask).
        position_ids = torch.arange(L).unsqueeze(0).expand(n, L).contiguous()
        shared = pack_shared([batch.prompt_ids[i] for i in rows], [batch.completion_ids[i] for i in rows], batch.pad_id)
        return MicroBatch(input_ids, attention_mask, position_ids, comp_index, mask,
                          torch.tensor([batch.advantages[i] for i in rows], dtype=torch.float32), beh, ref, shared)
