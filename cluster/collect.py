"""What collecting one step's batch produces: scored groups, the counters, the batch the learner gets.

The driver (`Trainer._collect`) does the generating and scoring; everything here is plain data and
pure functions, so the rules (what counts, what is trimmed, how groups become a batch) are unit-tested
without engines.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from cluster.data import Example

if TYPE_CHECKING:
    from actors.rollout import PromptRollout


class ScoredGroup(NamedTuple):
    """One prompt's G completions and their rewards."""

    example: Example
    rollout: PromptRollout
    rewards: list[float]


@dataclass
class CollectStats:
    """What collecting one batch saw, dropped groups included; part of the step's metrics."""

    rewards: list[float] = field(default_factory=list)  # of every scored completion, kept or dropped
    gen_tokens: int = 0
    gen_s: float = 0.0
    reward_s: float = 0.0
    reward_errors: int = 0  # reward calls that raised / timed out (their completions got the fallback)
    error_samples: list[str] = field(default_factory=list)  # the first round's messages that had any
    groups: int = 0  # groups scored
    failed_groups: int = 0  # groups whose every completion had a failed reward call
    zero_var_groups: int = 0  # groups whose rewards were all equal: no learning signal
    skipped_prompts: int = 0  # prompts the engines refused (e.g. too long)
    extra_prompts: int = 0  # prompts taken by dynamic sampling to replace dropped groups

    def add_group(self, rewards: list[float], gen_tokens: int, failed: bool) -> None:
        self.groups += 1
        self.rewards += rewards
        self.gen_tokens += gen_tokens
        self.failed_groups += failed
        self.zero_var_groups += max(rewards) == min(rewards)

    def every_group_failed(self) -> bool:
        """Training on fallback rewards only teaches nothing: the run should stop instead."""
        return self.groups > 0 and self.failed_groups == self.groups

    def metrics(self) -> dict:
        """This batch's share of the step's line in metrics.jsonl."""
        rewards = torch.tensor(self.rewards or [float("nan")], dtype=torch.float64)
        return {"reward_mean": rewards.mean().item(), "reward_std": rewards.std().item() if len(rewards) > 1 else 0.0,
                "reward_errors": self.reward_errors,
                "gen_tokens": self.gen_tokens, "gen_s": self.gen_s, "reward_s": self.reward_s,
                "zero_var_groups": self.zero_var_groups, "skipped_prompts": self.skipped_prompts,
                "extra_prompts": self.extra_prompts}


def trim_to_ranks(groups: list[ScoredGroup], group_size: int, ranks: int) -> list[ScoredGroup]:
    """Every learner rank needs the same number of sequences: drop groups from the end until they divide."""
    keep = len(groups)
    while keep and (keep * group_size) % ranks:
        keep -= 1
    return groups[:keep]


@dataclass
class Batch:
    """One step's groups, kept prompt-major: group g is completions[g*G:(g+1)*G]."""

    examples: list[Example]
    prompt_ids: list[list[int]]  # one per completion
    completion_ids: list[list[int]]
    behavior_logp: list[list[float]]
    rewards: list[float]
    weight_version: int  # the oldest version that generated any of it
    stream_state: dict  # data position before this batch was taken (what a checkpoint must record)
    stats: CollectStats = field(default_factory=CollectStats)

    @classmethod
    def from_groups(cls, groups: list[ScoredGroup], stream_state: dict, stats: CollectStats,
                    version_if_empty: int) -> Batch:
        return cls(
            examples=[g.example for g in groups],
            prompt_ids=[g.rollout.prompt_ids for g in groups for _ in g.rollout.completions],
            completion_ids=[c.token_ids for g in groups for c in g.rollout.completions],
            behavior_logp=[c.logprobs for g in groups for c in g.rollout.completions],
            rewards=[r for g in groups for r in g.rewards],
            weight_version=min((g.rollout.weight_version for g in groups), default=version_if_empty),
            stream_state=stream_state, stats=stats)
