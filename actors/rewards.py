"""Reward scoring: built-ins in-process, user functions (and math_verify) in isolated processes.

Two forms of reward function, told apart by their first parameter:

- per sample: `fn(prompt, completion, **fields) -> float`, called once per completion;
- batched, as TRL writes them: `fn(prompts, completions, **columns) -> list[float | None]`
  (first parameter named `prompts` or `completions`), called with keywords on a whole batch,
  so a TRL reward function works unchanged.

`prompt` is the dataset's prompt as it is there: a string, or a list of chat messages. For a
per-sample function `completion` is the generated text (special tokens removed). A batched
function gets what TRL passes: `completions[i]` is the text for string prompts and
`[{"role": "assistant", "content": text}]` for conversational ones, `completion_ids[i]` the
token ids, and every other column as a list (`answer=[...]`). Both forms also receive what the
scorer knows about a sample: `_num_tokens`, `_finish_reason` ("stop" | "length"),
`_max_new_tokens`, `_overlong_buffer`, `_answer_key` (per sample: values; batched: lists). A
function receives only the keywords its signature names, unless it takes `**kwargs`, so
`def reward(prompt, completion, answer)` works. A batched function may return None for a
sample it has no opinion on: it adds nothing to that sample's reward (as in TRL).

`RewardConfig.functions` names registry entries (actors/reward_functions.py: `exact_match`,
`format`, `overlong_penalty`, `gsm8k`, `math_verify`) or user code (`path/to/file.py:name`).
Built-ins run in-process (fast, trusted), except `math_verify`. User code runs in a small pool
of worker processes (actors/reward_pool.py): a call that raises, returns a non-number / NaN, exceeds `timeout_s` (its
process is killed and replaced), or kills its process is a reward *error*: counted per sample,
reported, and the sample gets `fallback` instead of a silent 0. A batched function's batch is
split into `num_procs` chunks, one call (and one timeout) each.

Multi-turn trajectories (actors/multiturn.py) are scored on the final assistant turn's text as
`completion`, with the whole conversation as `_messages` (a list of chat messages, prompt
included), `_turns`, and `_num_tokens` counting the model's tokens only; the environment's
own rewards (`Trajectory.env_reward`) are added to the weighted sum.

Deliberately light: no torch import, so the worker processes start fast.
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field

from actors.config import RewardConfig
from actors.reward_functions import (  # noqa: F401 - re-exported: the registry and built-ins live there
    ANSWER_CHECKERS,
    ISOLATED,
    REWARDS,
    exact_match,
    final_answer,
    format_reward,
    gsm8k,
    math_verify,
    overlong_penalty,
    parse_number,
    register,
)
from actors.reward_pool import RewardPool, call_one, is_file_spec

MAX_ERROR_SAMPLES = 5


def _chunks(n: int, k: int) -> list[list[int]]:
    size, extra = divmod(n, k)
    out, start = [], 0
    for i in range(k):
        end = start + size + (1 if i < extra else 0)
        out.append(list(range(start, end)))
        start = end
    return out


def _trl_completion(prompt, text: str):
    """What TRL passes as a completion: the text, or for a conversation one assistant message."""
    return [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text


def _columns(idx: list[int], ids: list, fields: list[dict]) -> dict:
    """Per-sample fields as TRL's column lists (a column a row lacks is None there)."""
    keys = list(dict.fromkeys(k for i in idx for k in fields[i]))
    cols = {k: [fields[i].get(k) for i in idx] for k in keys}
    if all(ids[i] is not None for i in idx):
        cols["completion_ids"] = [ids[i] for i in idx]
    return cols


# --------------------------------------------------------------------------- #
# The scorer
# --------------------------------------------------------------------------- #
@dataclass
class RewardResult:
    rewards: list[float]  # weighted sum per sample (fallback where a function failed)
    errors: int  # failed calls (raised, timed out, non-number, process died)
    error_samples: list[str]  # the first few error messages, for the log
    seconds: float
    per_function: dict[str, list[float]] = field(default_factory=dict)  # raw values (NaN = failed)


class RewardScorer:
    """Scores completions with the weighted sum of `cfg.functions`."""

    def __init__(self, cfg: RewardConfig):
        self.cfg = cfg
        self.weights = list(cfg.weights) or [1.0] * len(cfg.functions)
        self.pool: RewardPool | None = None
        self.validate()
        isolated = [s for s in cfg.functions if s in ISOLATED or (is_file_spec(s) and s not in REWARDS)]
        if isolated:
            self.pool = RewardPool(isolated, cfg.num_procs, cfg.timeout_s)

    def validate(self) -> None:
        """Fail at start, clearly, on a config that cannot score anything."""
        problems = self.cfg.problems()
        if problems:
            raise ValueError("invalid RewardConfig: " + "; ".join(problems))
        for spec in self.cfg.functions:
            if spec in REWARDS:
                continue
            if not is_file_spec(spec):
                raise ValueError(
                    f"unknown reward function {spec!r}; registered: {', '.join(sorted(REWARDS))}, "
                    "or user code as 'path/to/file.py:function_name'"
                )
            path = spec.rpartition(":")[0]
            if not os.path.isfile(path):
                raise ValueError(f"reward function file not found: {path} (from {spec!r}, cwd {os.getcwd()})")

    def _samples(self, completions: list, examples: list[dict], max_new_tokens: int | None):
        """(texts, token ids or None, per-sample keyword fields, environment rewards)."""
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
            f.setdefault("_overlong_buffer", self.cfg.overlong_buffer)
            f.setdefault("_answer_key", self.cfg.answer_key)
            texts.append(completion)
            fields.append(f)
        return texts, ids, fields, env_rewards

    def _values(self, specs: list[str], prompts: list, texts: list[str], ids: list, fields: list[dict]):
        """Every function's value per sample: ({spec: [value]}, failed per sample, error messages)."""
        n = len(texts)
        values = {spec: [math.nan] * n for spec in specs}
        failed = [False] * n
        errors: list[str] = []

        def record(spec, i, ok, value):
            if ok:
                values[spec][i] = 0.0 if value is None else value  # None: no opinion, adds nothing
            else:
                failed[i] = True
                errors.append(f"{spec} on sample {i}: {value}")

        pool_calls, where = [], []
        for spec in specs:
            if spec in REWARDS and spec not in ISOLATED:
                for i in range(n):
                    try:
                        record(spec, i, True, call_one(REWARDS[spec], prompts[i], texts[i], fields[i]))
                    except Exception as e:  # noqa: BLE001 - a failing reward is counted, not fatal
                        record(spec, i, False, f"{type(e).__name__}: {e}")
            elif self.pool.batched.get(spec):
                for chunk in (c for c in _chunks(n, self.cfg.num_procs) if c):
                    pool_calls.append((spec, ("batch", [prompts[i] for i in chunk],
                                              [_trl_completion(prompts[i], texts[i]) for i in chunk],
                                              _columns(chunk, ids, fields))))
                    where.append((spec, chunk))
            else:
                for i in range(n):
                    pool_calls.append((spec, ("one", prompts[i], texts[i], fields[i])))
                    where.append((spec, [i]))
        if pool_calls:
            for (spec, idx), (ok, value) in zip(where, self.pool.run(pool_calls)):
                for k, i in enumerate(idx):
                    record(spec, i, ok, value[k] if ok and isinstance(value, list) else value)
        return values, failed, errors

    def score(self, prompts: list, completions: list, examples: list[dict],
              max_new_tokens: int | None = None) -> RewardResult:
        """completions: strings, or Completion objects (then `_num_tokens`, `_finish_reason` and
        `completion_ids` come from them). examples[i] holds sample i's dataset fields (e.g. `answer`)."""
        if not len(prompts) == len(completions) == len(examples):
            raise ValueError(f"{len(prompts)} prompts, {len(completions)} completions, {len(examples)} examples")
        t0 = time.perf_counter()
        texts, ids, fields, env_rewards = self._samples(completions, examples, max_new_tokens)
        values, failed, errors = self._values(list(self.cfg.functions), prompts, texts, ids, fields)
        if errors:  # said when it happens, not only counted: the first error and how many
            print(f"reward: {len(errors)} of {len(texts) * len(self.cfg.functions)} reward call(s) failed "
                  f"(those samples get reward.fallback={self.cfg.fallback:g}), first: {errors[0]}",
                  file=sys.stderr, flush=True)
        rewards = [
            env_rewards[i] + (self.cfg.fallback if failed[i]
                              else sum(w * values[spec][i] for spec, w in zip(self.cfg.functions, self.weights)))
            for i in range(len(texts))
        ]
        return RewardResult(rewards, len(errors), errors[:MAX_ERROR_SAMPLES], time.perf_counter() - t0, values)

    def judge(self, prompts: list, completions: list, examples: list[dict]) -> list[bool]:
        """Is each completion correct? The verdict (1.0) of the first answer checker among the configured
        functions (gsm8k, math_verify, exact_match); without one, exact_match when the data has the answer
        column; else a positive total reward. (Held-out evaluation.)"""
        checker = next((s for s in self.cfg.functions if s in ANSWER_CHECKERS), None)
        if checker is None and examples and all(self.cfg.answer_key in e for e in examples):
            checker = "exact_match"
        if checker is None:
            return [r > 0 for r in self.score(prompts, completions, examples).rewards]
        texts, ids, fields, _ = self._samples(completions, examples, None)
        values, failed, _ = self._values([checker], prompts, texts, ids, fields)
        return [not bad and v == 1.0 for v, bad in zip(values[checker], failed)]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
