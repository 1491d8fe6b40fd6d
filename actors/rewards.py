"""Reward functions: a registry, the built-ins, and user functions run in isolated processes.

A reward function is `fn(prompt: str, completion: str, **example_fields) -> float`. The
example's fields (e.g. `answer`) arrive as keywords, plus what the scorer knows about the
sample: `_num_tokens` (completion length in tokens), `_finish_reason` ("stop" | "length"),
`_max_new_tokens` and `_overlong_buffer`. A function receives only the keywords its signature
names, unless it takes `**kwargs`, so `def reward(prompt, completion, answer)` works.

Multi-turn trajectories (actors/multiturn.py) are scored on the final assistant turn's text as
`completion`, with the whole conversation as `_messages` (a list of chat messages, prompt
included), `_turns`, and `_num_tokens` counting the model's tokens only; the environment's
own rewards (`Trajectory.env_reward`) are added to the weighted sum.

`RewardConfig.functions` names registry entries (`exact_match`) or user code
(`path/to/file.py:function_name`). Built-ins run in-process (fast, trusted). User code runs in
a small pool of worker processes: a call that raises, returns a non-number / NaN, exceeds
`timeout_s` (its process is killed and replaced), or kills its process is a reward *error*:
counted, reported, and the sample gets `fallback` instead of a silent 0.

Deliberately light: no torch import, so the worker processes start fast.
"""
from __future__ import annotations

import importlib.util
import inspect
import math
import multiprocessing as mp
import numbers
import os
import re
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from multiprocessing.connection import wait as wait_connections

from actors.config import RewardConfig

REWARDS: dict[str, Callable[..., float]] = {}
MAX_ERROR_SAMPLES = 5
STARTUP_TIMEOUT_S = 120.0


def register(name: str):
    """Decorator: make `fn` available as `RewardConfig.functions` entry `name`."""

    def deco(fn):
        REWARDS[name] = fn
        return fn

    return deco


# --------------------------------------------------------------------------- #
# Built-ins
# --------------------------------------------------------------------------- #
# A number: optional sign, digits with optional thousands commas ("1,234"), optional decimals.
_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[+-]?\.\d+")
_BARE_NUMBER = re.compile(rf"\s*(?:{_NUMBER.pattern})\s*")


def parse_number(text: str) -> Decimal | None:
    """'46', '46.0', ' +46 ', '1,000' -> Decimal; anything else -> None."""
    try:
        return Decimal(str(text).strip().replace(",", ""))
    except (InvalidOperation, ValueError):
        return None


def final_answer(completion: str) -> str | None:
    """The answer a completion gives: the first number after the last "answer:" if there is
    one, else the first number after the last "=", else the last number in the text."""
    lowered = completion.lower()
    for marker in ("answer:", "="):
        at = lowered.rfind(marker)
        if at >= 0:
            found = _NUMBER.search(completion, at + len(marker))
            if found:
                return found.group()
    numbers_ = _NUMBER.findall(completion)
    return numbers_[-1] if numbers_ else None


@register("exact_match")
def exact_match(prompt: str, completion: str, answer=None, **_) -> float:
    """1.0 if the completion's final answer equals the example's `answer` as a number
    ("46" == "46.0" == "+46"), else 0.0. A non-numeric `answer` is compared as stripped,
    case-insensitive text against the whole completion."""
    if answer is None:
        raise KeyError("exact_match needs an `answer` field in the example")
    expected = parse_number(answer)
    if expected is None:
        return float(completion.strip().lower() == str(answer).strip().lower())
    got = final_answer(completion)
    return float(got is not None and parse_number(got) == expected)


@register("format")
def format_reward(prompt: str, completion: str, _finish_reason: str | None = None, **_) -> float:
    """1.0 if the completion is just a number (surrounding whitespace allowed, nothing else)
    and generation ended by itself (EOS / a stop string: `_finish_reason == "stop"`, when the
    scorer knows it), else 0.0. Teaches "answer, then stop" on the arithmetic tasks."""
    if _finish_reason is not None and _finish_reason != "stop":
        return 0.0
    return float(_BARE_NUMBER.fullmatch(completion) is not None)


@register("overlong_penalty")
def overlong_penalty(prompt: str, completion: str, _num_tokens: int | None = None,
                     _max_new_tokens: int | None = None, _overlong_buffer: int = 8, **_) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025): 0 up to max_new_tokens - buffer
    tokens, then linear down to -1 at max_new_tokens (and -1 beyond)."""
    if _num_tokens is None or _max_new_tokens is None:
        raise KeyError("overlong_penalty needs _num_tokens and _max_new_tokens (pass Completion objects "
                       "or set them in the example, and max_new_tokens to score())")
    free = _max_new_tokens - _overlong_buffer
    if _num_tokens <= free:
        return 0.0
    if _num_tokens >= _max_new_tokens or _overlong_buffer <= 0:
        return -1.0
    return (free - _num_tokens) / _overlong_buffer


# --------------------------------------------------------------------------- #
# Calling a function with what it accepts, checking what it returns
# --------------------------------------------------------------------------- #
def _call(fn: Callable, prompt: str, completion: str, fields: dict):
    params = inspect.signature(fn).parameters.values()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        names = {p.name for p in params}
        fields = {k: v for k, v in fields.items() if k in names}
    return fn(prompt, completion, **fields)


def _as_reward(value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"returned {type(value).__name__} {value!r:.80}, not a number")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"returned {value}")
    return value


def _is_file_spec(spec: str) -> bool:
    path, sep, fn = spec.rpartition(":")
    return bool(sep and path.endswith(".py") and fn)


def load_file_function(spec: str) -> Callable:
    """`path/to/file.py:function_name` -> the function (imports the file as a module)."""
    path, _, name = spec.rpartition(":")
    module_name = "raygrpo_user_reward_" + re.sub(r"\W", "_", os.path.abspath(path))
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(f"{path} has no function {name!r} (it defines: {', '.join(defined) or 'nothing'})")
    return fn


# --------------------------------------------------------------------------- #
# Worker processes for user code
# --------------------------------------------------------------------------- #
def _worker_main(conn, specs: list[str]) -> None:
    """Load every user function once, say "ready", then answer calls until told to stop."""
    functions, errors = {}, {}
    for spec in specs:
        try:
            functions[spec] = load_file_function(spec)
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            errors[spec] = f"{type(e).__name__}: {e}"
    conn.send(("ready", errors))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        idx, spec, prompt, completion, fields = msg
        try:
            reply = ("result", idx, True, _as_reward(_call(functions[spec], prompt, completion, fields)))
        except BaseException as e:  # noqa: BLE001 - user code may raise anything, SystemExit included
            reply = ("result", idx, False, f"{type(e).__name__}: {e}")
        conn.send(reply)


class _Worker:
    """One isolated process and the parent's end of its pipe. `target(conn, specs)` runs in the
    child (the reward loop here; actors/envs.py runs its environment loop in the same shell)."""

    def __init__(self, ctx, specs, target=_worker_main, name="raygrpo-reward"):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, specs), daemon=True, name=name)
        self.proc.start()
        child.close()
        self.ready = False
        self.started = time.monotonic()
        self.load_errors: dict[str, str] = {}

    def kill(self):
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class RewardPool:
    """`num_procs` processes running user reward code, one call at a time each, with a
    per-call timeout: a stuck process is killed and replaced, so nothing can hang the run."""

    def __init__(self, specs: list[str], num_procs: int, timeout_s: float):
        self.specs, self.timeout_s = list(specs), timeout_s
        # spawn: forking a process that holds threads (Ray, vLLM) is unsafe.
        self.ctx = mp.get_context("spawn")
        self.workers = [_Worker(self.ctx, self.specs) for _ in range(num_procs)]
        self.replaced = 0
        self._await_ready()

    def _await_ready(self):
        """Wait until every worker loaded the user code; raise its load errors (bad function)."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not all(w.ready for w in self.workers):
            if time.monotonic() > deadline:
                raise TimeoutError(f"reward worker processes did not start in {STARTUP_TIMEOUT_S:.0f}s")
            self._poll(0.5, busy={}, results=[])
        errors = self.workers[0].load_errors
        if errors:
            self.close()
            raise ValueError("cannot load reward function(s): " + "; ".join(f"{s}: {e}" for s, e in errors.items()))

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self.workers[self.workers.index(worker)] = _Worker(self.ctx, self.specs)
        self.replaced += 1

    def _poll(self, timeout: float, busy: dict, results: list) -> None:
        """Receive what the workers sent within `timeout` seconds (a dead one is replaced)."""
        by_conn = {w.conn: w for w in self.workers}
        for conn in wait_connections(list(by_conn), timeout=max(timeout, 0.0)):
            worker = by_conn[conn]
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                if not worker.ready:  # died while importing the user code: a respawn would die the same way
                    worker.proc.join(5)
                    code = worker.proc.exitcode
                    self.close()
                    raise ValueError(
                        f"the reward process ended while importing {', '.join(self.specs)} (exit code {code}): "
                        "the module must not exit or crash when imported (e.g. sys.exit / os._exit at top level)") from None
                if worker in busy:
                    idx, _ = busy.pop(worker)
                    results[idx] = (False, f"reward process died (exit code {worker.proc.exitcode})")
                self._replace(worker)
                continue
            if msg[0] == "ready":
                worker.ready, worker.load_errors = True, msg[1]
            elif worker in busy and busy[worker][0] == msg[1]:
                busy.pop(worker)
                results[msg[1]] = (msg[2], msg[3])

    def run(self, calls: list[tuple]) -> list[tuple[bool, float | str]]:
        """calls: (spec, prompt, completion, fields) -> per call (True, reward) or (False, error)."""
        results: list = [None] * len(calls)
        pending, busy = deque(range(len(calls))), {}  # busy: worker -> (call index, deadline)
        last_ready = time.monotonic()
        while pending or busy:
            for w in self.workers:
                if pending and w.ready and w not in busy:
                    idx = pending.popleft()
                    w.conn.send((idx, *calls[idx]))
                    busy[w] = (idx, time.monotonic() + self.timeout_s)
            if busy:
                last_ready = time.monotonic()
            elif time.monotonic() - last_ready > STARTUP_TIMEOUT_S:
                raise RuntimeError("no reward worker process became ready")
            wait_s = min((dl for _, dl in busy.values()), default=time.monotonic() + 0.1) - time.monotonic()
            self._poll(min(wait_s, 0.5), busy, results)
            now = time.monotonic()
            for w, (idx, deadline) in list(busy.items()):
                if now > deadline:
                    busy.pop(w)
                    results[idx] = (False, f"timed out after {self.timeout_s:g}s")
                    self._replace(w)
        return results

    def close(self) -> None:
        for w in self.workers:
            try:
                w.conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        for w in self.workers:
            w.proc.join(1)
            w.kill()
        self.workers = []


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
        user = [s for s in cfg.functions if _is_file_spec(s) and s not in REWARDS]
        if user:
            self.pool = RewardPool(user, cfg.num_procs, cfg.timeout_s)

    def validate(self) -> None:
        """Fail at start, clearly, on a config that cannot score anything."""
        problems = self.cfg.problems()
        if problems:
            raise ValueError("invalid RewardConfig: " + "; ".join(problems))
        for spec in self.cfg.functions:
            if spec in REWARDS:
                continue
            if not _is_file_spec(spec):
                raise ValueError(
                    f"unknown reward function {spec!r}; registered: {', '.join(sorted(REWARDS))}, "
                    "or user code as 'path/to/file.py:function_name'"
                )
            path = spec.rpartition(":")[0]
            if not os.path.isfile(path):
                raise ValueError(f"reward function file not found: {path} (from {spec!r}, cwd {os.getcwd()})")

    def score(self, prompts: list[str], completions: list, examples: list[dict],
              max_new_tokens: int | None = None) -> RewardResult:
        """completions: strings, Completion objects (then `_num_tokens` and `_finish_reason`
        come from them) or multi-turn Trajectory objects (see the module docstring).
        examples[i] holds sample i's dataset fields (e.g. `answer`)."""
        if not len(prompts) == len(completions) == len(examples):
            raise ValueError(f"{len(prompts)} prompts, {len(completions)} completions, {len(examples)} examples")
        t0 = time.perf_counter()
        texts, fields, env_rewards = [], [], []
        for completion, example in zip(completions, examples):
            f = {k: v for k, v in example.items() if k not in ("prompt", "completion")}
            env_rewards.append(float(getattr(completion, "env_reward", 0.0)))
            if hasattr(completion, "loss_mask"):  # a multi-turn trajectory
                f.setdefault("_num_tokens", sum(completion.loss_mask))
                f.setdefault("_finish_reason", completion.finish_reason)
                f.setdefault("_messages", completion.messages)
                f.setdefault("_turns", completion.turns)
                completion = completion.text
            elif hasattr(completion, "token_ids"):
                f.setdefault("_num_tokens", len(completion.token_ids))
                f.setdefault("_finish_reason", completion.finish_reason)
                completion = completion.text
            if max_new_tokens is not None:
                f.setdefault("_max_new_tokens", max_new_tokens)
            f.setdefault("_overlong_buffer", self.cfg.overlong_buffer)
            texts.append(completion)
            fields.append(f)

        n = len(texts)
        values = {spec: [math.nan] * n for spec in self.cfg.functions}
        failed = [False] * n
        errors: list[str] = []

        def record(spec, i, ok, value):
            if ok:
                values[spec][i] = value
            else:
                failed[i] = True
                errors.append(f"{spec} on sample {i}: {value}")

        user_calls = []
        for spec in self.cfg.functions:
            if spec in REWARDS:
                for i in range(n):
                    try:
                        record(spec, i, True, _as_reward(_call(REWARDS[spec], prompts[i], texts[i], fields[i])))
                    except Exception as e:  # noqa: BLE001 - a failing reward is counted, not fatal
                        record(spec, i, False, f"{type(e).__name__}: {e}")
            else:
                user_calls += [(spec, i) for i in range(n)]
        if user_calls:
            assert self.pool is not None
            out = self.pool.run([(spec, prompts[i], texts[i], fields[i]) for spec, i in user_calls])
            for (spec, i), (ok, value) in zip(user_calls, out):
                record(spec, i, ok, value)

        if errors:  # said when it happens, not only counted: the first error and how many
            print(f"reward: {len(errors)} of {n * len(self.cfg.functions)} reward call(s) failed "
                  f"(those samples get reward.fallback={self.cfg.fallback:g}), first: {errors[0]}",
                  file=sys.stderr, flush=True)
        rewards = [
            env_rewards[i] + (self.cfg.fallback if failed[i]
                              else sum(w * values[spec][i] for spec, w in zip(self.cfg.functions, self.weights)))
            for i in range(n)
        ]
        return RewardResult(rewards, len(errors), errors[:MAX_ERROR_SAMPLES], time.perf_counter() - t0, values)

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
