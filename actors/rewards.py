"""Reward scoring: every kind of `reward.functions` entry, weighted and summed, with per-function health.

Kinds (actors/reward_kinds.py): built-ins run in-process (fast, trusted), except `math_verify`;
user code (`path/to/file.py:name`) and `math_verify` run in isolated worker processes
(actors/reward_pool.py); `model:PATH` is scored by a RewardModelActor (actors/reward_model.py,
started by the driver, attached with `attach_model`); `http(s)://...` by a remote verifier
(actors/reward_http.py). All kinds of one batch run at the same time; a slow batch prints a
line at least every 15 s saying what it waits on (actors/reward_progress.py).

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

Errors. A call that raises, returns a non-number / NaN, exceeds its timeout or kills its process
is a reward *error*: counted per function, printed, and the sample gets `reward.fallback`.

Multi-turn trajectories (actors/multiturn.py) are scored on the final assistant turn's text as
`completion`, with the whole conversation as `_messages` (a reward model reads that), `_turns`,
and `_num_tokens` counting the model's tokens only; the environment's own rewards
(`Trajectory.env_reward`) are added to the weighted sum.

Deliberately light: no torch import.
"""
from __future__ import annotations

import math
import sys
import time
from concurrent.futures import Future
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
from actors.reward_http import HttpVerifier, VerifierRefused  # noqa: F401 - VerifierRefused: callers catch it
from actors.reward_kinds import default_name, has_chat_template, kind_of, model_path, resolve, safe_name, spec_problems
from actors.reward_pool import TIMED_OUT, RewardPool, call_one
from actors.reward_progress import ScoringProgress

MAX_ERROR_SAMPLES = 5
NAN = float("nan")
# Per reward function and step, metrics rewards/<name>/<stat>: TRL's mean and std (over the values it
# gave), then errors, unscorable samples (nulls) and seconds; reward models add `truncated`.
REWARD_STATS = ("mean", "std", "errors", "unscorable", "s")


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


def is_error(v) -> bool:
    return isinstance(v, float) and math.isnan(v)


# --------------------------------------------------------------------------- #
# What one batch gave
# --------------------------------------------------------------------------- #
@dataclass
class FunctionStats:
    """One reward function over one batch (summed over a step's batches by the driver)."""

    values: list[float] = field(default_factory=list)  # the values it gave (errors and nulls not included)
    errors: int = 0  # samples it failed on (raised, timed out, non-number, process died)
    unscorable: int = 0  # samples it returned null for
    calls: int = 0  # calls made (per sample, per chunk, per request, per model batch)
    timeouts: int = 0  # calls that ran out of time
    seconds: float = 0.0  # from the start of scoring until its last value came back
    truncated: int | None = None  # reward models: inputs cut to reward.model_max_len (None: not a model)


@dataclass
class RewardResult:
    rewards: list[float]  # weighted sum per sample: NaN = unscorable; reward.fallback where a call failed
    errors: int  # failed (function, sample) pairs
    error_samples: list[str]  # the first few error messages, for the log
    seconds: float
    per_function: dict[str, list] = field(default_factory=dict)  # spec -> raw values (None = null, NaN = error)
    functions: dict[str, FunctionStats] = field(default_factory=dict)  # name -> this batch's stats
    unscorable: int = 0  # samples left out of their group and of the loss
    failed: list[bool] = field(default_factory=list)  # per sample: a call failed (it got reward.fallback)


def combine(values: dict[str, list], weights: dict[str, float], failed: list[bool], env_rewards: list[float],
            fallback: float, group_size: int) -> tuple[list[float], list[bool]]:
    """The reward of every sample (NaN: unscorable) and which are unscorable; see the module docstring.
    values: spec -> per sample a float, None (null) or NaN (error)."""
    n = len(failed)
    rewards, unscorable = [0.0] * n, [False] * n
    for g in range(0, n, group_size):
        group = range(g, min(g + group_size, n))
        applies = [s for s in values if any(values[s][i] is not None for i in group)]
        for i in group:
            if failed[i]:
                rewards[i] = env_rewards[i] + fallback
            elif values and (not applies or any(values[s][i] is None for s in applies)):
                rewards[i], unscorable[i] = NAN, True
            else:
                rewards[i] = env_rewards[i] + sum(weights[s] * values[s][i] for s in applies)
    return rewards, unscorable


# --------------------------------------------------------------------------- #
# The scorer
# --------------------------------------------------------------------------- #
class RewardScorer:
    """Scores completions with the weighted sum of `cfg.functions`."""

    def __init__(self, cfg: RewardConfig):
        self.cfg = cfg
        self.validate()
        self.specs = [resolve(s) for s in cfg.functions]  # paths made absolute: they cross into other processes
        self.weights = dict(zip(self.specs, list(cfg.weights) or [1.0] * len(self.specs)))
        self.models: dict[str, object] = {}  # spec -> submit(prompts, texts, messages) -> Future of a dict
        isolated = [s for s in self.specs if s in ISOLATED or kind_of(s) == "file"]
        self.pool: RewardPool | None = RewardPool(isolated, cfg.num_procs, cfg.timeout_s) if isolated else None
        self.http: dict[str, HttpVerifier] = {s: HttpVerifier(s, cfg) for s in self.specs if kind_of(s) == "http"}
        defaults = [default_name(s, self.pool.names if self.pool else None) for s in self.specs]
        self.names = dict(zip(self.specs, [safe_name(n) for n in cfg.names] or defaults))
        taken = [n for n in self.names.values() if list(self.names.values()).count(n) > 1]
        if taken:
            self.close()
            raise ValueError(f"two reward functions share the metric name {taken[0]!r}; give each its own "
                             f"with reward.names (one per reward.functions entry)")

    def validate(self) -> None:
        """Fail at start, clearly, on a config that cannot score anything."""
        problems = self.cfg.problems() + [p for s in self.cfg.functions for p in spec_problems(s)]
        twice = sorted({s for s in self.cfg.functions if self.cfg.functions.count(s) > 1})
        if twice:
            problems.append(f"reward.functions lists {', '.join(twice)} more than once (give it a larger reward.weights entry)")
        if problems:
            raise ValueError("invalid RewardConfig: " + "; ".join(problems))

    def model_specs(self) -> list[str]:
        """The model:PATH entries (absolute), for the driver to start a RewardModelActor for each."""
        return [s for s in self.specs if kind_of(s) == "model"]

    def data_problems(self, chat: bool) -> list[str]:
        """What keeps these functions from scoring the run's data (chat: its prompts are messages)."""
        return [f"the reward model {model_path(s)} has no chat template, but the data's prompts are chat messages: "
                "give its tokenizer a chat template (tokenizer_config.json or chat_template.jinja)"
                for s in self.model_specs() if chat and not has_chat_template(model_path(s))]

    def metric_keys(self) -> list[str]:
        """Every per-function metric a step reports (cluster/metrics.py logs exactly these beside STEP_KEYS)."""
        return [f"rewards/{self.names[s]}/{stat}" for s in self.specs
                for stat in REWARD_STATS + (("truncated",) if kind_of(s) == "model" else ())]

    def timeout_setting(self, name: str) -> str | None:
        """The setting that bounds one call of the function called `name` ("reward.timeout_s=10"), if any."""
        spec = next(s for s in self.specs if self.names[s] == name)
        if kind_of(spec) == "http":
            return f"reward.http_timeout_s={self.cfg.http_timeout_s:g}"
        if kind_of(spec) == "file" or spec in ISOLATED:
            return f"reward.timeout_s={self.cfg.timeout_s:g}"
        return None

    def attach_model(self, spec: str, submit) -> None:
        """`submit(prompts, completions, messages)` -> a Future of {"values", "truncated", "seconds", "pid"}."""
        self.models[spec] = submit

    # ------------------------------------------------------------------ samples
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

    # ------------------------------------------------------------------ every function's values
    def _values(self, specs: list[str], prompts: list, texts: list[str], ids: list, fields: list[dict]):
        """({spec: per sample float | None | NaN}, {spec: FunctionStats}, error messages)."""
        n, t0 = len(texts), time.monotonic()
        values = {s: [NAN] * n for s in specs}
        stats = {s: FunctionStats() for s in specs}
        errors: list[str] = []
        notes = {s: f"reward.timeout_s={self.cfg.timeout_s:g}" for s in specs if kind_of(s) == "file" or s in ISOLATED}
        notes |= {s: f"reward.http_timeout_s={self.cfg.http_timeout_s:g}" for s in specs if kind_of(s) == "http"}

        def record(spec, i, ok, value):
            if ok:
                values[spec][i] = value
            else:
                errors.append(f"{self.names.get(spec, spec)} on sample {i}: {value}")

        with ScoringProgress({s: self.names.get(s, s) for s in specs}, notes) as progress:
            # Started first, waited for last: the verifiers and reward models work while the pool does.
            pending_http = {s: self._start_http(s, prompts, texts, ids, fields, progress)
                            for s in specs if kind_of(s) == "http"}
            pending_models = {s: self._start_model(s, prompts, texts, fields, progress) for s in specs if kind_of(s) == "model"}
            pool_calls, where = [], []
            for spec in specs:
                if kind_of(spec) == "builtin" and spec not in ISOLATED:
                    for i in range(n):
                        try:
                            record(spec, i, True, call_one(REWARDS[spec], prompts[i], texts[i], fields[i]))
                        except Exception as e:  # noqa: BLE001 - a failing reward is counted, not fatal
                            record(spec, i, False, f"{type(e).__name__}: {e}")
                    stats[spec].calls, stats[spec].seconds = n, time.monotonic() - t0
                elif self.pool is not None and spec in self.pool.specs:
                    calls = list(self._pool_calls(spec, prompts, texts, ids, fields))
                    pool_calls += [(spec, call) for call, _ in calls]
                    where += [(spec, idx) for _, idx in calls]
                    progress.add(spec, len(calls))
            if pool_calls:
                for (spec, idx), (ok, value) in zip(where, self.pool.run(pool_calls, progress)):
                    stats[spec].calls += 1
                    stats[spec].timeouts += (not ok and str(value).startswith(TIMED_OUT))
                    for k, i in enumerate(idx):
                        record(spec, i, ok, value[k] if ok and isinstance(value, list) else value)
            for spec, futures in pending_http.items():
                for outcome, (idx, _) in zip(self.http[spec].collect([f for _, f in futures]), futures):
                    stats[spec].calls += 1
                    stats[spec].timeouts += outcome.timed_out
                    for i, (ok, value) in zip(idx, outcome.results):
                        record(spec, i, ok, value)
            for spec, future in pending_models.items():
                out = future.result()
                stats[spec].calls, stats[spec].truncated = 1, out["truncated"]
                for i, v in enumerate(out["values"]):
                    finite = math.isfinite(v)
                    record(spec, i, finite, v if finite else f"the reward model's score is {v}")
        for spec in specs:
            st = stats[spec]
            st.seconds = st.seconds or progress.last_done.get(spec, time.monotonic()) - t0
            st.values = [v for v in values[spec] if v is not None and not is_error(v)]
            st.unscorable = sum(v is None for v in values[spec])
            st.errors = sum(is_error(v) for v in values[spec])
        return values, stats, errors

    def _pool_calls(self, spec, prompts, texts, ids, fields):
        """(call, sample indices) for one pooled function: per sample, or TRL-style chunks."""
        n = len(texts)
        if self.pool.batched.get(spec):
            for chunk in (c for c in _chunks(n, self.cfg.num_procs) if c):
                yield ("batch", [prompts[i] for i in chunk], [_trl_completion(prompts[i], texts[i]) for i in chunk],
                       _columns(chunk, ids, fields)), chunk
        else:
            for i in range(n):
                yield ("one", prompts[i], texts[i], fields[i]), [i]

    def _start_http(self, spec, prompts, texts, ids, fields, progress) -> list:
        """Requests of at most reward.http_max_batch samples, sent at once; [((future, n), indices)]."""
        batches = [list(range(s, min(s + self.cfg.http_max_batch, len(texts))))
                   for s in range(0, len(texts), self.cfg.http_max_batch)]
        payloads = [{"prompts": [prompts[i] for i in idx], "completions": [_trl_completion(prompts[i], texts[i]) for i in idx],
                     **_columns(idx, ids, fields)} for idx in batches]
        progress.add(spec, len(payloads))
        futures = self.http[spec].start(payloads)
        for fut, _ in futures:
            fut.add_done_callback(lambda f, spec=spec: progress.finish(
                spec, timed_out=not f.exception() and f.result().timed_out))
        return list(zip(batches, futures))

    def _start_model(self, spec, prompts, texts, fields, progress) -> Future:
        if spec not in self.models:
            raise RuntimeError(f"the reward model {spec} has no actor attached (the driver starts one per model: entry)")
        progress.add(spec)
        messages = [f.get("_messages") for f in fields]
        future = self.models[spec](prompts, texts, messages if any(messages) else None)
        future.add_done_callback(lambda f, spec=spec: progress.finish(spec))
        return future

    # ------------------------------------------------------------------ the public calls
    def score(self, prompts: list, completions: list, examples: list[dict], max_new_tokens: int | None = None,
              group_size: int | None = None) -> RewardResult:
        """completions: strings, or Completion objects (then `_num_tokens`, `_finish_reason` and
        `completion_ids` come from them). examples[i] holds sample i's dataset fields (e.g. `answer`).
        group_size: G, the samples of one prompt being adjacent (None: every sample is its own group)."""
        if not len(prompts) == len(completions) == len(examples):
            raise ValueError(f"{len(prompts)} prompts, {len(completions)} completions, {len(examples)} examples")
        t0 = time.perf_counter()
        texts, ids, fields, env_rewards = self._samples(completions, examples, max_new_tokens)
        values, stats, errors = self._values(self.specs, prompts, texts, ids, fields)
        failed = [any(is_error(values[s][i]) for s in self.specs) for i in range(len(texts))]
        if errors:  # said when it happens, not only counted: the first error and how many
            print(f"reward: {len(errors)} of {len(texts) * len(self.specs)} reward call(s) failed "
                  f"(those samples get reward.fallback={self.cfg.fallback:g}), first: {errors[0]}",
                  file=sys.stderr, flush=True)
        rewards, unscorable = combine(values, self.weights, failed, env_rewards, self.cfg.fallback, group_size or 1)
        return RewardResult(rewards, len(errors), errors[:MAX_ERROR_SAMPLES], time.perf_counter() - t0, values,
                            {self.names[s]: stats[s] for s in self.specs}, sum(unscorable), failed)

    def judge(self, prompts: list, completions: list, examples: list[dict]) -> list[bool]:
        """Is each completion correct? The verdict (1.0) of the first answer checker among the configured
        functions (gsm8k, math_verify, exact_match); without one, exact_match when the data has the answer
        column; else a positive total reward. (Held-out evaluation.)"""
        checker = next((s for s in self.specs if s in ANSWER_CHECKERS), None)
        if checker is None and examples and all(self.cfg.answer_key in e for e in examples):
            checker = "exact_match"
        if checker is None:
            return [r > 0 for r in self.score(prompts, completions, examples).rewards]  # NaN > 0 is False
        texts, ids, fields, _ = self._samples(completions, examples, None)
        values, _, _ = self._values([checker], prompts, texts, ids, fields)
        return [v == 1.0 for v in values[checker]]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        for verifier in self.http.values():
            verifier.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
