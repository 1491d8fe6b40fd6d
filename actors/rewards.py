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
of worker processes: a call that raises, returns a non-number / NaN, exceeds `timeout_s` (its
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
from multiprocessing.connection import wait as wait_connections

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

MAX_ERROR_SAMPLES = 5
STARTUP_TIMEOUT_S = 120.0


# --------------------------------------------------------------------------- #
# Calling a function with what it accepts, checking what it returns
# --------------------------------------------------------------------------- #
def is_batched(fn: Callable) -> bool:
    """TRL's form: the first parameter is `prompts` or `completions` (plural)."""
    params = list(inspect.signature(fn).parameters.values())
    return bool(params) and params[0].name in ("prompts", "completions")


def _accepted(fn: Callable, kwargs: dict) -> dict:
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return kwargs
    names = {p.name for p in params}
    return {k: v for k, v in kwargs.items() if k in names}


def _call(fn: Callable, prompt, completion: str, fields: dict) -> float:
    """A per-sample call, its value checked."""
    return _as_reward(fn(prompt, completion, **_accepted(fn, fields)))


def _call_batched(fn: Callable, prompts: list, completions: list, columns: dict) -> list[float | None]:
    """A TRL-style call with keywords, its values checked (one per prompt; None allowed)."""
    out = fn(**_accepted(fn, {"prompts": prompts, "completions": completions, **columns}))
    if not isinstance(out, (list, tuple)) or len(out) != len(prompts):
        raise TypeError(f"returned {type(out).__name__} {out!r:.80}, not a list of {len(prompts)} rewards")
    return [None if v is None else _as_reward(v) for v in out]


def _run_call(fn: Callable, call: tuple):
    """call: ("one", prompt, completion, fields) or ("batch", prompts, completions, columns)."""
    kind, a, b, c = call
    return _call_batched(fn, a, b, c) if kind == "batch" else _call(fn, a, b, c)


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
def _load(spec: str) -> Callable:
    return REWARDS[spec] if spec in REWARDS else load_file_function(spec)


def _worker_main(conn, specs: list[str]) -> None:
    """Load every function once, say "ready" (with load errors and which are batched), then answer
    calls until told to stop."""
    functions, errors, batched = {}, {}, {}
    for spec in specs:
        try:
            functions[spec] = _load(spec)
            batched[spec] = is_batched(functions[spec])
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            errors[spec] = f"{type(e).__name__}: {e}"
    conn.send(("ready", errors, batched))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        idx, spec, call = msg
        try:
            reply = ("result", idx, True, _run_call(functions[spec], call))
        except BaseException as e:  # noqa: BLE001 - user code may raise anything, SystemExit included
            reply = ("result", idx, False, f"{type(e).__name__}: {e}")
        conn.send(reply)


class WorkerProcess:
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
        self.batched: dict[str, bool] = {}

    def kill(self):
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


def close_workers(workers: list[WorkerProcess]) -> None:
    """Ask each process to exit (None on its pipe), give it a moment, then make sure it is gone."""
    for w in workers:
        try:
            w.conn.send(None)
        except (OSError, BrokenPipeError):
            pass
    for w in workers:
        w.proc.join(1)
        w.kill()


class RewardPool:
    """`num_procs` processes running user reward code, one call at a time each, with a
    per-call timeout: a stuck process is killed and replaced, so nothing can hang the run."""

    def __init__(self, specs: list[str], num_procs: int, timeout_s: float):
        self.specs, self.timeout_s = list(specs), timeout_s
        # spawn: forking a process that holds threads (Ray, vLLM) is unsafe.
        self.ctx = mp.get_context("spawn")
        self.workers = [WorkerProcess(self.ctx, self.specs) for _ in range(num_procs)]
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
        self.batched = dict(self.workers[0].batched)  # spec -> TRL-style batched function?
        if errors:
            self.close()
            raise ValueError("cannot load reward function(s): " + "; ".join(f"{s}: {e}" for s, e in errors.items()))

    def _replace(self, worker: WorkerProcess) -> None:
        worker.kill()
        self.workers[self.workers.index(worker)] = WorkerProcess(self.ctx, self.specs)
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
                worker.ready, worker.load_errors, worker.batched = True, msg[1], msg[2]
            elif worker in busy and busy[worker][0] == msg[1]:
                busy.pop(worker)
                results[msg[1]] = (msg[2], msg[3])

    def run(self, calls: list[tuple]) -> list[tuple[bool, float | str]]:
        """calls: (spec, call) with call as `_run_call` takes it -> per call (True, value) or (False, error)."""
        results: list = [None] * len(calls)
        pending, busy = deque(range(len(calls))), {}  # busy: worker -> (call index, deadline)
        last_ready = time.monotonic()
        while pending or busy:
            for w in self.workers:
                if pending and w.ready and w not in busy:
                    idx = pending.popleft()
                    w.conn.send((idx, *calls[idx]))  # (idx, spec, call)
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
        close_workers(self.workers)
        self.workers = []


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
        isolated = [s for s in cfg.functions if s in ISOLATED or (_is_file_spec(s) and s not in REWARDS)]
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
            if not _is_file_spec(spec):
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
                        record(spec, i, True, _call(REWARDS[spec], prompts[i], texts[i], fields[i]))
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
