"""Reward scoring: every kind of `reward.functions` entry, weighted and summed, with per-function health.

Kinds (the table in registry.py; one module each): built-ins run in-process (fast, trusted), except
`math_verify`; user code (`path/to/file.py:name`) and `math_verify` run in isolated worker
processes (python.py, pool.py); `model:PATH` is scored by a RewardModelActor (model.py,
model_actor.py: the driver starts it and attaches its handle with `attach`); `http(s)://...` by a
remote verifier (http.py). All kinds of one batch run at the same time; a slow batch prints a
line at least every 15 s saying what it waits on (progress.py).

Two forms of Python reward function, told apart by their first parameter:

- per sample: `fn(prompt, completion, **fields) -> float | None`, called once per completion;
- batched, as TRL writes them: `fn(prompts, completions, **columns) -> list[float | None]`
  (first parameter named `prompts` or `completions`), called with keywords on a whole batch,
  so a TRL reward function works unchanged.

`prompt` is the dataset's prompt as it is there: a string, or a list of chat messages. For a
per-sample function `completion` is the generated text (special tokens removed). A batched
function (and a verifier) gets what TRL passes: `completions[i]` is the text for string prompts
and `[{"role": "assistant", "content": text}]` for conversational ones, `completion_ids[i]` the
token ids, and every other column as a list (`answer=[...]`). Both forms also receive what the
scorer knows about a sample: `_num_tokens`, `_finish_reason` ("stop" | "length"),
`_max_new_tokens`, `_overlong_buffer`, `_answer_key` (per sample: values; batched: lists). A
function receives only the keywords its signature names, unless it takes `**kwargs`.

Null rewards. A function (of any kind) that returns None / null for a sample says it cannot score
it. Within a group (the G completions of one prompt): a function that returned null for *some* of
the group makes those samples *unscorable*: their reward is NaN, they are left out of the group's
statistics and of the loss (the learner's mask), never scored as 0, and counted. A function that
returned null for *every* sample of a group has no opinion on that prompt (TRL's multi-task use)
and is left out of the group's sum; a group no function scored is unscorable as a whole (with no
function configured, an environment's reward alone scores every sample).

Errors: a function fails alone. A call that raises, returns a non-number / NaN, exceeds its timeout
or kills its process (a verifier: a request that failed, see http.py) is a reward *error*: counted
per function, and said per function with its first error. Within a group:
- a function that failed on *every* sample of the group is left out of the group's sum, and the
  others' weights are scaled up by sum(|w| of all functions) / sum(|w| of the functions left), so
  the group's rewards keep the scale they have when every function works. A broken function (a
  verifier that answers 500) thus fails alone: the step goes on with the functions that work;
- a function that failed on *some* samples of the group gives those samples `reward.fallback`, in
  place of their whole sum (a flaky call inside a working function);
- a group that every function failed on (none left that scored it) gets `reward.fallback` for
  every sample: those samples are `failed`. The driver halts a step where no sample was scored,
  and a function that failed every call for `trainer.halt_after` steps in a row (cluster/run/health.py).
Leaving a function out of a whole group, not only out of the samples it failed, keeps every sample
of a group scored by the same functions with the same weights, so their advantages compare like
with like.

Multi-turn trajectories (actors/multiturn/trajectories.py) are scored on the final assistant turn's text as
`completion`, with the whole conversation as `_messages` (a reward model reads that), `_turns`,
and `_num_tokens` counting the model's tokens only; the environment's own rewards
(`Trajectory.env_reward`) are added to the weighted sum.

Deliberately light: no torch import.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from actors.config import RewardConfig
from actors.rewards.base import NAN, Batch, FunctionStats, Tally, is_error
from actors.rewards.entries import REWARD_STATS, RewardEntries
from actors.rewards.functions import ANSWER_CHECKERS
from actors.rewards.progress import ScoringProgress
from actors.rewards.registry import KINDS, kind_for

MAX_ERROR_SAMPLES = 5
__all__ = ["REWARD_STATS", "RewardResult", "RewardScorer", "combine"]  # REWARD_STATS: the metrics' stats (entries.py)


# --------------------------------------------------------------------------- #
# What one batch gave
# --------------------------------------------------------------------------- #
@dataclass
class RewardResult:
    rewards: list[float]  # weighted sum per sample: NaN = unscorable; reward.fallback where it failed (see combine)
    errors: int  # failed (function, sample) pairs
    error_samples: list[str]  # the first few error messages, for the log
    seconds: float
    per_function: dict[str, list] = field(default_factory=dict)  # spec -> raw values (None = null, NaN = error)
    functions: dict[str, FunctionStats] = field(default_factory=dict)  # name -> this batch's stats
    unscorable: int = 0  # samples left out of their group and of the loss
    failed: list[bool] = field(default_factory=list)  # per sample: it got reward.fallback (see combine)
    # per sample: a code reward's tests, [{"test", "outcome", "detail"}] (actors/rewards/code.py); None: no code reward
    tests: list = field(default_factory=list)


def combine(values: dict[str, list], weights: dict[str, float], env_rewards: list[float], fallback: float,
            group_size: int) -> tuple[list[float], list[bool], list[bool]]:
    """The reward of every sample (NaN: unscorable), which are unscorable, and which got `fallback`
    (failed); the rule is the module docstring's. values: spec -> per sample a float, None (null) or NaN (error)."""
    n = len(env_rewards)
    rewards, unscorable, failed = [0.0] * n, [False] * n, [False] * n
    total = sum(abs(weights[s]) for s in values)
    for g in range(0, n, group_size):
        group = range(g, min(g + group_size, n))
        broken = {s for s in values if all(is_error(values[s][i]) for i in group)}  # failed the whole group
        left = [s for s in values if s not in broken]
        applies = [s for s in left if any(values[s][i] is not None for i in group)]
        kept = sum(abs(weights[s]) for s in left)
        scale = total / kept if broken and kept else 1.0
        for i in group:
            if (broken and not applies) or any(is_error(values[s][i]) for s in left):
                rewards[i], failed[i] = env_rewards[i] + fallback, True
            elif values and (not applies or any(values[s][i] is None for s in applies)):
                rewards[i], unscorable[i] = NAN, True
            else:
                rewards[i] = env_rewards[i] + scale * sum(weights[s] * values[s][i] for s in applies)
    return rewards, unscorable, failed


# --------------------------------------------------------------------------- #
# What a function is given
# --------------------------------------------------------------------------- #
def sample_fields(cfg: RewardConfig, completions: list, examples: list[dict], max_new_tokens: int | None):
    """What each sample is scored on: (texts, token ids or None, per-sample keyword fields, environment
    rewards). The fields are the example's columns and what the scorer knows of the sample (module docstring)."""
    texts, ids, fields, env_rewards = [], [], [], []
    for completion, example in zip(completions, examples):
        f = {k: v for k, v in example.items() if k not in ("prompt", "completion")}
        env_rewards.append(float(getattr(completion, "env_reward", 0.0)))
        if hasattr(completion, "loss_mask"):  # a multi-turn trajectory
            f.setdefault("_num_tokens", sum(completion.loss_mask))
            f.setdefault("_finish_reason", completion.finish_reason)
            f.setdefault("_messages", completion.messages)
            f.setdefault("_turns", completion.turns)
            ids.append(None)
            completion = completion.text
        elif hasattr(completion, "token_ids"):
            f.setdefault("_num_tokens", len(completion.token_ids))
            f.setdefault("_finish_reason", completion.finish_reason)
            ids.append(completion.token_ids)
            completion = completion.text
        else:
            ids.append(None)
        if max_new_tokens is not None:
            f.setdefault("_max_new_tokens", max_new_tokens)
        f.setdefault("_overlong_buffer", cfg.overlong_buffer)
        f.setdefault("_answer_key", cfg.answer_key)
        texts.append(completion)
        fields.append(f)
    return texts, ids, fields, env_rewards


# --------------------------------------------------------------------------- #
# The scorer
# --------------------------------------------------------------------------- #
class RewardScorer:
    """Scores completions with the weighted sum of `cfg.functions`. The entries themselves (names, kinds,
    runners, the actors they call) are a RewardEntries (entries.py), whose answers to the driver this
    scorer passes on; scoring a batch (`score`, `judge`) is its own."""

    def __init__(self, cfg: RewardConfig):
        self.cfg = cfg
        self.entries = RewardEntries(cfg)  # checked (every problem at once), named, runners started
        entries = self.entries
        # The same objects as the entries' (read by the driver's metrics, the score command and the tests).
        self.specs, self.weights, self.names, self.runners = entries.specs, entries.weights, entries.names, entries.runners

    # ------------------------------------------------------------------ the entries' answers (entries.py)
    def actor_paths(self) -> dict[str, str]:
        return self.entries.actor_paths()

    def attach(self, handles: dict, timeout_s: float) -> None:
        self.entries.attach(handles, timeout_s)

    def restarted_actors(self) -> list[str]:
        return self.entries.restarted_actors()

    @property
    def restarts(self) -> int:
        return self.entries.restarts()

    def data_problems(self, chat: bool) -> list[str]:
        return self.entries.data_problems(chat)

    def metric_keys(self) -> list[str]:
        return self.entries.metric_keys()

    def timeout_setting(self, name: str) -> str | None:
        return self.entries.timeout_setting(name)

    # ------------------------------------------------------------------ every function's values
    def _values(self, specs: list[str], batch: Batch) -> Tally:
        """The Tally: per spec and sample float | None | NaN, per spec its FunctionStats, the error messages."""
        tally = Tally(specs, len(batch), self.names)
        kinds = {s: self.entries.kinds.get(s) or kind_for(s) for s in specs}
        notes = {s: note for s in specs if (note := kinds[s].timeout_setting(s, self.cfg)) is not None}
        with ScoringProgress({s: self.names.get(s, s) for s in specs}, notes) as progress:
            # Sent to every kind before any is waited for: the verifiers and reward models work while the
            # Python functions are scored (registry.KINDS: python is sent last).
            waits = [self.entries.runner(kind).send(mine, batch, tally, progress) for kind in KINDS.values()
                     if (mine := [s for s in specs if kinds[s] is kind])]
            for wait in waits:
                wait()
        for spec in specs:
            st, values = tally.stats[spec], tally.values[spec]
            st.seconds = st.seconds or progress.last_done.get(spec, time.monotonic()) - tally.t0
            st.values = [v for v in values if v is not None and not is_error(v)]
            st.unscorable = sum(v is None for v in values)
            st.errors = sum(is_error(v) for v in values)
        return tally

    # ------------------------------------------------------------------ the public calls
    def score(self, prompts: list, completions: list, examples: list[dict], max_new_tokens: int | None = None,
              group_size: int | None = None) -> RewardResult:
        """completions: strings, or Completion objects (then `_num_tokens`, `_finish_reason` and
        `completion_ids` come from them). examples[i] holds sample i's dataset fields (e.g. `answer`).
        group_size: G, the samples of one prompt being adjacent (None: every sample is its own group)."""
        if not len(prompts) == len(completions) == len(examples):
            raise ValueError(f"{len(prompts)} prompts, {len(completions)} completions, {len(examples)} examples")
        t0 = time.perf_counter()
        texts, ids, fields, env_rewards = sample_fields(self.cfg, completions, examples, max_new_tokens)
        tally = self._values(self.specs, Batch(prompts, texts, ids, fields))
        values, stats, errors = tally.values, tally.stats, tally.errors
        rewards, unscorable, failed = combine(values, self.weights, env_rewards, self.cfg.fallback, group_size or 1)
        for spec in self.specs:  # said when it happens, per function, not only counted: how many and its first error
            bad = [i for i, v in enumerate(values[spec]) if is_error(v)]
            if bad:
                fell = sum(failed[i] for i in bad)
                what = [f"{len(bad) - fell} left out of their prompt's sum, the other functions' weights "
                        "renormalised"] if len(bad) > fell else []
                what += [f"{fell} given reward.fallback={self.cfg.fallback:g}"] if fell else []
                print(f"reward: {self.names[spec]} failed {len(bad)} of {len(texts)} sample(s) ({'; '.join(what)}), "
                      f"first: {stats[spec].first_error}", file=sys.stderr, flush=True)
        return RewardResult(rewards, len(errors), errors[:MAX_ERROR_SAMPLES], time.perf_counter() - t0, values,
                            {self.names[s]: stats[s] for s in self.specs}, sum(unscorable), failed, tally.tests)

    def judge(self, prompts: list, completions: list, examples: list[dict]) -> list[bool]:
        """Is each completion correct? The verdict (1.0) of the first answer checker among the configured
        functions (gsm8k, math_verify, exact_match, or a kind that judges: code_tests, every test passed);
        without one, exact_match when the data has the answer column; else a positive total reward.
        (Held-out evaluation.)"""
        checker = next((s for s in self.specs if s in ANSWER_CHECKERS or self.entries.kinds[s].judges), None)
        if checker is None and examples and all(self.cfg.answer_key in e for e in examples):
            checker = "exact_match"
        if checker is None:
            return [r > 0 for r in self.score(prompts, completions, examples).rewards]  # NaN > 0 is False
        texts, ids, fields, _ = sample_fields(self.cfg, completions, examples, None)
        values = self._values([checker], Batch(prompts, texts, ids, fields)).values
        return [v == 1.0 for v in values[checker]]

    def close(self) -> None:
        entries = getattr(self, "entries", None)  # None: __init__ failed (and closed what it had started)
        if entries is not None:
            entries.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
