"""What collecting one step's batch produces: scored groups, the counters, the batch the learner gets.

The driver (`Trainer._collect`) does the generating; everything here is plain data and functions
(scoring goes through the scorer handed in), so the rules (what counts, what is trimmed, how groups
become a batch) are unit-tested without engines.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
from safetensors.torch import load_file, save_file

from cluster.data.dataset import Example
from cluster.run.completions import finite_or_none, sample_rows
from learner.grpo import group_advantages

if TYPE_CHECKING:
    from actors.completions import PromptRollout


class ScoredGroup(NamedTuple):
    """One prompt's G completions and their rewards (NaN: unscorable, trained on with a mask of 0s)."""

    example: Example
    rollout: PromptRollout
    rewards: list[float]
    # the rows of its completions kept for completions.jsonl (also in CollectStats.samples): their advantage is
    # the one the batch trains them with, filled in by Batch.from_groups
    samples: tuple[dict, ...] = ()


def scorable(rewards: list[float]) -> list[float]:
    """The rewards that are numbers (NaN marks a sample a reward function could not score)."""
    return [r for r in rewards if not math.isnan(r)]


def has_signal(rewards: list[float]) -> bool:
    """A group teaches something only if at least two of its scorable rewards differ."""
    values = scorable(rewards)
    return len(values) >= 2 and max(values) != min(values)


@dataclass
class CollectStats:
    """What collecting one batch saw, dropped groups included; part of the step's metrics."""

    rewards: list[float] = field(default_factory=list)  # of every scored completion, kept or dropped
    gen_tokens: int = 0
    gen_s: float = 0.0
    reward_s: float = 0.0
    ref_s: float = 0.0  # the reference actor's log-probs of the kept completions
    reward_errors: int = 0  # (function, completion) pairs that failed: raised, timed out, not a number
    reward_unscorable: int = 0  # completions no reward could score: out of their group and the loss
    error_samples: list[str] = field(default_factory=list)  # the first round's messages that had any
    # per reward function name: {"values", "errors", "unscorable", "calls", "timeouts", "seconds", "truncated",
    # "first_error" (once it had one)}
    reward_functions: dict = field(default_factory=dict)
    groups: int = 0  # groups scored
    failed_groups: int = 0  # groups no reward function scored (every completion got reward.fallback)
    zero_var_groups: int = 0  # groups whose rewards were all equal: no learning signal
    skipped_prompts: int = 0  # prompts the engines refused (e.g. too long)
    extra_prompts: int = 0  # prompts taken by dynamic sampling to replace dropped groups
    # multi-turn rollouts (rollout.env), over every trajectory generated, dropped groups included
    trajectories: int = 0
    turns: int = 0  # assistant turns
    tool_calls: int = 0  # "tool" messages the environments answered with
    env_errors: int = 0  # environment calls that raised / hung / broke the contract (each ended its trajectory)
    env_overflows: int = 0  # trajectories ended because the environment's messages did not fit in max_model_len
    env_s: float = 0.0  # seconds the engines waited on environments (summed over engines)
    env_tokens: int = 0  # environment tokens (context, not trained on)
    # completion lengths in model tokens (environment tokens not counted), every scored completion
    lengths: list[int] = field(default_factory=list)
    clipped: int = 0  # completions cut at rollout.max_new_tokens (multi-turn: whose last turn was cut)
    turn_lengths: list[int] = field(default_factory=list)  # multi-turn: every assistant turn's
    turn_clipped: int = 0  # multi-turn: turns cut at rollout.max_new_tokens or by the trajectory's budget
    samples: list[dict] = field(default_factory=list)  # completions logged for this step (cluster/run/completions.py)

    def add_trajectories(self, rollouts: list) -> None:
        """Count what the multi-turn rollouts (actors.multiturn.trajectories.MultiTurnRollout) of a round did."""
        for ro in rollouts:
            self.env_s += ro.env_s
            for t in ro.trajectories:
                self.trajectories += 1
                self.turns += t.turns
                self.tool_calls += t.tool_calls
                self.env_errors += t.env_error is not None
                self.env_overflows += t.env_overflow_tokens > 0
                self.env_tokens += t.env_tokens

    def add_group(self, rewards: list[float], gen_tokens: int, failed: bool) -> None:
        self.groups += 1
        self.rewards += scorable(rewards)
        self.reward_unscorable += len(rewards) - len(scorable(rewards))
        self.gen_tokens += gen_tokens
        self.failed_groups += failed
        self.zero_var_groups += not has_signal(rewards)

    def add_functions(self, functions: dict) -> None:
        """Sum one scoring round's per-function stats (actors.rewards.base.FunctionStats by name) into the step's."""
        for name, st in functions.items():
            acc = self.reward_functions.setdefault(name, {"values": [], "errors": 0, "unscorable": 0, "calls": 0,
                                                          "timeouts": 0, "seconds": 0.0, "truncated": None})
            for key in acc:
                if key not in ("truncated", "first_error"):
                    acc[key] += getattr(st, key)
            if st.truncated is not None:  # a reward model
                acc["truncated"] = (acc["truncated"] or 0) + st.truncated
            if st.first_error is not None and not acc.get("first_error"):
                acc["first_error"] = st.first_error

    def merge(self, other: CollectStats) -> None:
        """Add `other`'s counts to these (trainer.mode=pipeline scores each group on its own as it arrives,
        and a step's stats are those of the groups it took)."""
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name == "error_samples":
                self.error_samples = mine or theirs
            elif f.name == "reward_functions":
                for name, acc in theirs.items():
                    into = mine.setdefault(name, {"values": [], "errors": 0, "unscorable": 0, "calls": 0,
                                                  "timeouts": 0, "seconds": 0.0, "truncated": None})
                    for key, value in acc.items():
                        if key == "first_error":
                            into[key] = into.get(key) or value
                        elif key == "truncated":
                            into[key] = value if into[key] is None else into[key] + (value or 0)
                        else:
                            into[key] = into[key] + value
            else:
                setattr(self, f.name, mine + theirs)

    def function_errors(self, timeout_setting=lambda name: None) -> dict[str, str]:
        """Every reward function with an error in this step -> what a halt says of it: whether it failed
        every call, its error count and its first error (`timeout_setting(name)`: the setting that
        bounds its calls, named when every call timed out)."""
        out = {}
        for name, acc in self.reward_functions.items():
            if not acc["errors"]:
                continue
            every = not acc["values"] and not acc["unscorable"]
            hung = acc["calls"] and acc["timeouts"] == acc["calls"]
            why = f", every call timed out ({timeout_setting(name)})" if hung and timeout_setting(name) else ""
            out[name] = (f"the reward function {name} failed {'every call' if every else 'some calls'} "
                         f"({acc['errors']} error(s){why}), first: {acc.get('first_error') or '(no message)'}")
        return out

    def failed_functions(self) -> list[str]:
        """Reward functions that failed every call they were given in this step (no value, no null)."""
        return [name for name, acc in self.reward_functions.items()
                if acc["errors"] and not acc["values"] and not acc["unscorable"]]

    def add_lengths(self, rollout, eos_id: int | None) -> None:
        """Count the lengths of a scored rollout's completions (multi-turn: also per assistant turn,
        a turn being a run of model tokens in the loss mask, cut when it does not end with EOS)."""
        for c in rollout.completions:
            if hasattr(c, "loss_mask"):  # a multi-turn trajectory (actors/multiturn/trajectories.py)
                self.lengths.append(sum(c.loss_mask))
                self.clipped += not c.turn_ended
                for turn in model_turns(c.token_ids, c.loss_mask):
                    self.turn_lengths.append(len(turn))
                    self.turn_clipped += turn[-1] != eos_id
            else:
                self.lengths.append(len(c.token_ids))
                self.clipped += c.finish_reason == "length"

    def every_group_failed(self) -> bool:
        """No reward function scored any sample (each got reward.fallback): nothing to learn from, the run
        halts (after this step's metrics row)."""
        return self.groups > 0 and self.failed_groups == self.groups

    def metrics(self) -> dict:
        """This batch's share of the step's line in metrics.jsonl."""
        rewards = torch.tensor(self.rewards or [float("nan")], dtype=torch.float64)
        return {"reward_mean": rewards.mean().item(), "reward_std": rewards.std().item() if len(rewards) > 1 else 0.0,
                "reward_errors": self.reward_errors, "reward_unscorable": self.reward_unscorable,
                **self._function_metrics(),
                "gen_tokens": self.gen_tokens, "gen_s": self.gen_s, "reward_s": self.reward_s,
                "zero_var_groups": self.zero_var_groups, "skipped_prompts": self.skipped_prompts,
                "extra_prompts": self.extra_prompts, **self._length_metrics(), **self._multiturn_metrics()}

    def _length_metrics(self) -> dict:
        """TRL's completions/* names; the turn_* ones for multi-turn runs (NaN otherwise)."""
        out = {}
        for prefix, lengths, clipped in (("", self.lengths, self.clipped), ("turn_", self.turn_lengths, self.turn_clipped)):
            if lengths:
                out |= {f"completions/{prefix}mean_length": sum(lengths) / len(lengths),
                        f"completions/{prefix}min_length": min(lengths), f"completions/{prefix}max_length": max(lengths),
                        f"completions/{prefix}clipped_ratio": clipped / len(lengths)}
        return out

    def _function_metrics(self) -> dict:
        out = {}
        for name, acc in self.reward_functions.items():
            v = torch.tensor(acc["values"] or [float("nan")], dtype=torch.float64)
            # no values: NaN (null) for both, not a std of 0.0 beside a null mean (issue 59); one value: no spread
            std = v.std().item() if len(v) > 1 else (0.0 if acc["values"] else float("nan"))
            out |= {f"rewards/{name}/mean": v.mean().item(), f"rewards/{name}/std": std,
                    f"rewards/{name}/errors": acc["errors"], f"rewards/{name}/unscorable": acc["unscorable"],
                    f"rewards/{name}/s": acc["seconds"]}
            if acc["truncated"] is not None:
                out[f"rewards/{name}/truncated"] = acc["truncated"]
        return out

    def _multiturn_metrics(self) -> dict:
        if not self.trajectories:  # a single-turn run: the logger writes NaN for these
            return {}
        n = self.trajectories
        return {"turns_mean": self.turns / n, "tool_calls_mean": self.tool_calls / n, "env_errors": self.env_errors,
                "env_overflows": self.env_overflows, "env_s": self.env_s, "env_tokens_mean": self.env_tokens / n}

    def every_trajectory_failed(self) -> bool:
        """Every trajectory of the batch ended on an environment error: what the health guard watches."""
        return self.trajectories > 0 and self.env_errors == self.trajectories


class EnvironmentNotes:
    """What the console says about environments, as it says reward errors: failures when they happen
    (how many, and the first one's text), and once per run that the environment's messages overflowed."""

    def __init__(self, max_model_len: int):
        self.max_model_len, self.overflow_said = max_model_len, False

    def lines(self, rollouts: list, what: str) -> list[str]:
        """Lines for one round of multi-turn rollouts (actors.multiturn.trajectories.MultiTurnRollout); `what`: "step 3"."""
        trajectories = [t for ro in rollouts for t in ro.trajectories]
        failed = [t.env_error for t in trajectories if t.env_error is not None]
        out = []
        if failed:
            out.append(f"environment: {len(failed)} of {len(trajectories)} trajectories failed at {what} (each ended "
                       f"there; counted as env_errors), first: {failed[0]}")
        over = [t.env_overflow_tokens for t in trajectories if t.env_overflow_tokens]
        if over and not self.overflow_said:
            self.overflow_said = True
            out.append(f"environment: its messages ({max(over):,} tokens) did not fit in rollout.max_model_len="
                       f"{self.max_model_len} at {what}; {len(over)} trajectory(ies) ended there (counted as "
                       "env_overflows; said once per run). Shorten the tool output or raise rollout.max_model_len")
        return out


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
    # per completion: the advantage the learner trains it with (None only in a batch loaded from a
    # checkpoint written before batches carried them; the resume computes them, `batch_advantages`)
    advantages: list[float] | None
    weight_version: int  # the oldest version that generated any of it
    stream_state: dict  # data position before this batch was taken (what a checkpoint must record)
    stats: CollectStats = field(default_factory=CollectStats)
    # per completion token: 1 = sampled by the model, 0 = environment (multi-turn); None: all the model's
    loss_mask: list[list[int]] | None = None
    # per completion token: the reference model's log-prob, when the reference actor computed it
    # while the batch was collected (None: no reference actor, or beta = 0)
    ref_logp: list[list[float]] | None = None
    # per completion token: the weight version that sampled it, when the engines stamp each token
    # (trainer.mode=pipeline); None: every token of a group is its rollout's `weight_version`
    token_versions: list[list[int]] | None = None

    def versions(self) -> list[list[int]]:
        """Per completion, per token, the weight version that sampled it (whatever the mode)."""
        if self.token_versions is not None:
            return self.token_versions
        return [[self.weight_version] * len(c) for c in self.completion_ids]

    @classmethod
    def from_groups(cls, groups: list[ScoredGroup], stream_state: dict, stats: CollectStats,
                    version_if_empty: int, advantage_estimator: str) -> Batch:
        """The batch of the groups kept for training, with the advantages the learner trains them
        with: computed here, once, over exactly these groups; their logged samples (ScoredGroup.samples)
        are given the same values."""
        # training_rows(): (prompt_ids, completion_ids, behavior_logp, loss_mask or None) per completion,
        # the same for single-turn (actors/rollout.py) and multi-turn (actors/multiturn/trajectories.py) rollouts
        rows = [row for g in groups for row in g.rollout.training_rows()]
        rewards = [r for g in groups for r in g.rewards]
        # an unscorable completion (NaN reward) is kept in its group's place with a loss mask of 0s
        rows = [(p, c, b, [0] * len(c)) if math.isnan(r) else (p, c, b, m) for (p, c, b, m), r in zip(rows, rewards)]
        masked = any(r[3] is not None for r in rows)
        versions = [getattr(c, "versions", None) for g in groups for c in g.rollout.completions]
        group_size = len(groups[0].rewards) if groups else 0
        advantages = batch_advantages(rewards, group_size, advantage_estimator)
        for g, group in enumerate(groups):  # the logged samples read the advantages their batch trains them with
            for row in group.samples:
                row["advantage"] = finite_or_none(advantages[g * group_size + row["sample"]])
        return cls(
            examples=[g.example for g in groups],
            prompt_ids=[r[0] for r in rows], completion_ids=[r[1] for r in rows], behavior_logp=[r[2] for r in rows],
            rewards=rewards, advantages=advantages,
            weight_version=min((g.rollout.weight_version for g in groups), default=version_if_empty),
            stream_state=stream_state, stats=stats,
            loss_mask=[r[3] if r[3] is not None else [1] * len(r[1]) for r in rows] if masked else None,
            token_versions=versions if versions and all(v is not None for v in versions) else None)


# The next step's batch beside a checkpoint (async: see Trainer.save_checkpoint): the per-token
# values as flat safetensors (float64 holds vLLM's and the reference's float32 values exactly),
# the rest as JSON. Nothing is unpickled (learner/checkpoint.py, "Safety").
NEXT_BATCH_TENSORS, NEXT_BATCH_JSON = "next_batch.safetensors", "next_batch.json"
_RAGGED = {"prompt_ids": torch.int64, "completion_ids": torch.int64, "behavior_logp": torch.float64,
           "ref_logp": torch.float64, "loss_mask": torch.int64, "token_versions": torch.int64}


def batch_advantages(rewards: list[float], group_size: int, advantage_estimator: str) -> list[float]:
    """The advantages the learner trains a batch with: one `group_advantages` call over the whole
    batch's rewards (Batch.from_groups; the logged samples read them there). Not pieced together from
    the rounds' groups: torch reduces a lone row by another path than several rows, so a one-group
    round's std can differ from the batch's in the last bit."""
    if not rewards:
        return []
    return group_advantages(torch.tensor(rewards, dtype=torch.float64), group_size, advantage_estimator).tolist()


def save_batch(batch: Batch, directory: str | Path) -> None:
    """Write `batch` into `directory` so that load_batch gives it back value for value."""
    tensors = {"rewards": torch.tensor(batch.rewards, dtype=torch.float64)}
    if batch.advantages is not None:
        tensors["advantages"] = torch.tensor(batch.advantages, dtype=torch.float64)
    for name, dtype in _RAGGED.items():
        rows = getattr(batch, name)
        if rows is not None:
            tensors[name] = torch.tensor([v for r in rows for v in r], dtype=dtype)
            tensors[name + ".lengths"] = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    save_file(tensors, str(Path(directory) / NEXT_BATCH_TENSORS))
    # Examples are kept for what they are (the prompts the groups came from); their rewards are already
    # in the batch. A dataset value JSON cannot hold is kept as its str().
    meta = {"weight_version": batch.weight_version, "stream_state": batch.stream_state,
            "stats": dataclasses.asdict(batch.stats), "examples": [dataclasses.asdict(e) for e in batch.examples]}
    (Path(directory) / NEXT_BATCH_JSON).write_text(json.dumps(meta, allow_nan=True, default=str))


def load_batch(directory: str | Path) -> Batch | None:
    """The batch save_batch wrote into `directory`; None if there is none. One saved before batches
    carried their advantages comes back with `advantages` None."""
    directory = Path(directory)
    if not (directory / NEXT_BATCH_JSON).is_file():
        return None
    meta = json.loads((directory / NEXT_BATCH_JSON).read_text())
    tensors = load_file(str(directory / NEXT_BATCH_TENSORS))

    def ragged(name: str) -> list[list] | None:
        if name not in tensors:
            return None
        flat, lengths = tensors[name].tolist(), tensors[name + ".lengths"].tolist()
        ends = list(itertools.accumulate(lengths))
        return [flat[e - n:e] for e, n in zip(ends, lengths)]

    return Batch(examples=[Example(**e) for e in meta["examples"]], prompt_ids=ragged("prompt_ids"),
                 completion_ids=ragged("completion_ids"), behavior_logp=ragged("behavior_logp"),
                 rewards=tensors["rewards"].tolist(),
                 advantages=tensors["advantages"].tolist() if "advantages" in tensors else None,
                 weight_version=meta["weight_version"],
                 stream_state=meta["stream_state"], stats=CollectStats(**meta["stats"]),
                 loss_mask=ragged("loss_mask"), ref_logp=ragged("ref_logp"), token_versions=ragged("token_versions"))


def model_turns(token_ids: list[int], loss_mask: list[int]) -> list[list[int]]:
    """The model's turns of a multi-turn trajectory: each run of tokens whose loss mask is 1
    (environment tokens, at least the next turn's generation prompt, always separate two turns)."""
    turns, current = [], []
    for tok, m in zip(token_ids, loss_mask):
        if m:
            current.append(tok)
        elif current:
            turns.append(current)
            current = []
    return turns + ([current] if current else [])


def model_tokens(rollout) -> int:
    """Tokens the model sampled in a rollout's completions (environment tokens not counted)."""
    return sum(len(ids) if mask is None else sum(mask) for _, ids, _, mask in rollout.training_rows())


def sample_seed(seed: int, step: int, round_: int, i: int) -> int:
    """Per-request vLLM seed: generation is reproducible across restarts and resumes.
    (Two requests may share a seed in huge batches; they hold different prompts, so no harm.)"""
    return (seed * 1_000_003 + step * 10_007 + round_ * 101 + i) % (2**31)


def score_groups(scorer, live: list, G: int, stats: CollectStats, *, max_new_tokens: int,
                 dynamic_sampling: bool, eos_id: int | None = None, samples: int = 0) -> list[ScoredGroup]:
    """Rewards for every completion of `live` (example, rollout) pairs, G completions each, from
    `scorer` (actors/rewards/scorer.py RewardScorer); every group is counted in `stats` (with its completions'
    lengths; `eos_id` ends a multi-turn turn), and with dynamic sampling the groups without signal are
    not returned. Up to `samples` completions are kept in `stats.samples` (cluster/run/completions.py),
    each also in its group's `samples`: the batch made of the group gives it its advantage (Batch.from_groups);
    a group without signal, never trained on, has advantage 0 (group_advantages gives it exactly 0)."""
    if not live:
        return []
    # one call for the whole round: user reward code fans out over the scorer's processes
    res = scorer.score([ex.prompt for ex, _ in live for _ in range(G)],
                       [c for _, ro in live for c in ro.completions],
                       [ex.fields for ex, _ in live for _ in range(G)],
                       max_new_tokens=max_new_tokens, group_size=G)
    stats.reward_errors += res.errors
    stats.add_functions(res.functions)
    stats.error_samples = stats.error_samples or res.error_samples
    rows: list[dict] = []
    if samples > len(stats.samples):
        by_name = {scorer.names[spec]: values for spec, values in res.per_function.items()}  # the metrics' names
        rows = sample_rows(live, res.rewards, by_name, None, G, samples - len(stats.samples), res.tests)
        stats.samples += rows
    groups = []
    for g, (ex, ro) in enumerate(live):
        rewards = res.rewards[g * G:(g + 1) * G]
        failed = all(res.failed[g * G:(g + 1) * G])
        stats.add_group(rewards, model_tokens(ro), failed)
        stats.add_lengths(ro, eos_id)
        logged = tuple(row for row in rows if row["prompt_index"] == g)
        if dynamic_sampling and not has_signal(rewards):
            for row in logged:
                row["advantage"] = 0.0  # no learning signal: dropped, never trained on (group_advantages: exactly 0)
        else:
            groups.append(ScoredGroup(ex, ro, rewards, logged))
    return groups
