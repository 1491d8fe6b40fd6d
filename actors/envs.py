"""Environments for multi-turn rollouts: the contract, the built-ins, and the isolated pool that runs them.

The contract (`rollout.env: path/to/file.py:ClassName`, or a built-in name from ENVS):

    class MyEnv:
        def __init__(self, **example_fields): ...       # one instance per trajectory
        def reset(self) -> list[dict] | None: ...        # messages to add before the first turn
        def step(self, assistant_text: str) -> dict: ... # after every assistant turn:
            # {"messages": [{"role": "tool" | "user", "content": str}, ...],  (may be empty)
            #  "done": bool, "reward": float (optional, added to the trajectory's reward)}

Tools are the environment's business: it reads the assistant's text and answers in messages.

Environment code runs in `num_procs` separate processes (the reward pool's process shell,
actors/rewards.py), with `timeout_s` per call. A call that raises, returns something outside
the contract, exceeds the timeout (its process is killed and replaced) or kills its process
fails *its* trajectory only: the caller ends that trajectory and counts an env error. An
environment is stateful and lives in one process; when that process is replaced, the other
environments it hosted are rebuilt there by replaying their calls (constructor, reset, steps).

Deliberately light: no torch import, so the processes start fast.
"""
from __future__ import annotations

import math
import multiprocessing as mp
import numbers
import os
import re
import time
from collections import deque
from multiprocessing.connection import wait as wait_connections

from actors.reward_pool import STARTUP_TIMEOUT_S, WorkerProcess, close_workers, load_file_function, serve

ROLES = ("system", "user", "assistant", "tool")
ENVS: dict[str, type] = {}


def register_env(name: str):
    def deco(cls):
        ENVS[name] = cls
        return cls

    return deco


# --------------------------------------------------------------------------- #
# Built-in: a calculator tool for word problems
# --------------------------------------------------------------------------- #
_CALL = re.compile(r"calc\(([^()]*(?:\([^()]*\)[^()]*)*)\)")
_SAFE_EXPR = re.compile(r"[0-9+\-*/(). ]+")


def safe_eval(expr: str) -> str:
    """Arithmetic only (digits, + - * / parentheses, decimals): the answer as text, or an error text."""
    if not _SAFE_EXPR.fullmatch(expr) or len(expr) > 200 or "**" in expr:
        return "error: only numbers, + - * / and parentheses"
    try:
        value = eval(compile(expr, "<calc>", "eval"), {"__builtins__": {}}, {})  # noqa: S307 - charset checked above
    except ZeroDivisionError:
        return "error: division by zero"
    except Exception:  # noqa: BLE001 - a malformed expression is the model's mistake, answered as text
        return "error: malformed expression"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 6) if isinstance(value, float) else value)


# A system prompt that tells the model about the tool (the data carries it: the system prompt lives in the data).
CALC_SYSTEM_PROMPT = ("Solve the problem. You may write calc(expression) to use a calculator; its result comes "
                      "back in the next message. End with the answer after ####.")


@register_env("calculator")
class CalculatorEnv:
    """The model may write `calc(<expression>)` in a turn; the environment answers with a `tool`
    message holding the result, and the model continues. A turn without a call ends the episode
    (its text is the final answer, scored by the reward functions). `answer` (if the data has
    one) is not used here: scoring is the rewards' job."""

    def __init__(self, **fields):
        self.fields = fields

    def reset(self):
        return None

    def step(self, assistant_text: str) -> dict:
        calls = _CALL.findall(assistant_text)
        if not calls:
            return {"messages": [], "done": True}
        return {"messages": [{"role": "tool", "content": safe_eval(c.strip())} for c in calls], "done": False}


# --------------------------------------------------------------------------- #
# Loading and checking what an environment returns
# --------------------------------------------------------------------------- #
def is_env_file_spec(spec: str) -> bool:
    path, sep, name = spec.rpartition(":")
    return bool(sep and path.endswith(".py") and name)


def env_spec_problems(spec: str) -> list[str]:
    """What is wrong with `rollout.env` (checked at start, before any actor runs)."""
    if not spec or spec in ENVS:
        return []
    if not is_env_file_spec(spec):
        return [f"rollout.env {spec!r} is neither a built-in environment ({', '.join(sorted(ENVS))}) "
                "nor user code as 'path/to/file.py:ClassName'"]
    path = spec.rpartition(":")[0]
    if not os.path.isfile(path):
        return [f"rollout.env file not found: {path} (from {spec!r}, cwd {os.getcwd()})"]
    return []


def load_env_class(spec: str):
    if spec in ENVS:
        return ENVS[spec]
    cls = load_file_function(spec)  # any callable attribute: a class is one
    for method in ("reset", "step"):
        if not callable(getattr(cls, method, None)):
            raise TypeError(f"{spec} has no method {method}(): an environment needs reset() and step(assistant_text)")
    return cls


def check_messages(messages, where: str) -> list[dict]:
    if messages is None:
        return []
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"{where} returned messages of type {type(messages).__name__}, expected a list of dicts")
    out = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise TypeError(f"{where} returned the message {m!r:.120}; expected {{'role': one of {ROLES}, "
                            "'content': str}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def check_step(result) -> dict:
    if not isinstance(result, dict):
        raise TypeError(f"step() returned {type(result).__name__} {result!r:.80}, expected a dict "
                        "with 'messages', 'done' and optionally 'reward'")
    unknown = set(result) - {"messages", "done", "reward"}
    if unknown:
        raise TypeError(f"step() returned unknown keys {sorted(unknown)}")
    if not isinstance(result.get("done"), bool):
        raise TypeError(f"step() returned done={result.get('done')!r}, expected True or False")
    reward = result.get("reward")
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
            raise TypeError(f"step() returned reward={reward!r}, expected a finite number")
        reward = float(reward)
    return {"messages": check_messages(result.get("messages"), "step()"), "done": result["done"],
            "reward": reward or 0.0}


# --------------------------------------------------------------------------- #
# The isolated processes
# --------------------------------------------------------------------------- #
def _env_main(conn, specs: list[str]) -> None:
    """Load the environment class, say "ready", then serve (key, method, payload) calls."""
    (spec,) = specs
    try:
        cls, error = load_env_class(spec), None
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        cls, error = None, f"{type(e).__name__}: {e}"
    conn.send(("ready", {spec: error} if error else {}))
    envs: dict = {}

    def answer(msg: tuple) -> tuple:
        key, method, payload = msg
        try:
            if method == "open":
                envs[key] = cls(**payload)
                value = check_messages(envs[key].reset(), "reset()")
            elif method == "step":
                value = check_step(envs[key].step(payload))
            else:  # close
                envs.pop(key, None)
                value = None
            return ("result", key, True, value)
        except BaseException as e:  # noqa: BLE001 - environment code may raise anything
            return ("result", key, False, f"{type(e).__name__}: {e}"[:500])

    serve(conn, answer)


class EnvPool:
    """Environments in `num_procs` processes; `run` serves one batch of calls, each bounded by `timeout_s`.

    A key (the caller's trajectory id) is bound to one process at its "open". Calls of one process
    are served in order, one at a time; different processes work in parallel.
    """

    def __init__(self, spec: str, num_procs: int, timeout_s: float):
        self.spec, self.timeout_s = spec, timeout_s
        self.ctx = mp.get_context("spawn")  # forking a process that holds threads (Ray, vLLM) is unsafe
        self.workers = [self._start() for _ in range(num_procs)]
        self.slot: dict = {}  # key -> process index
        self.history: dict = {}  # key -> the calls that built its current state (replayed after a restart)
        self.broken: dict = {}  # key -> why its environment is gone
        self.replaced = 0
        self._pending_replays: dict[int, list] = {}  # process index -> keys to rebuild there before its next call
        self._await_ready()

    def _start(self) -> WorkerProcess:
        return WorkerProcess(self.ctx, [self.spec], target=_env_main, name="raygrpo-env")

    def _await_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not all(w.ready for w in self.workers):
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"environment processes did not start in {STARTUP_TIMEOUT_S:.0f}s")
            for conn in wait_connections([w.conn for w in self.workers if not w.ready], timeout=0.5):
                w = next(w for w in self.workers if w.conn is conn)
                try:
                    _, w.load_errors = conn.recv()
                except (EOFError, OSError):
                    self.close()
                    raise RuntimeError(f"an environment process died at start (loading {self.spec})") from None
                w.ready = True
        errors = self.workers[0].load_errors
        if errors:
            self.close()
            raise ValueError(f"cannot load environment {self.spec}: {errors[self.spec]}")

    def _replace(self, index: int, lost_key) -> None:
        """Kill process `index`, start a new one, and mark its other environments for a replay."""
        self.workers[index].kill()
        self.workers[index] = self._start()
        self.replaced += 1
        for key, slot in self.slot.items():
            if slot == index and key != lost_key and key not in self.broken:
                self._pending_replays.setdefault(index, []).append(key)

    def run(self, calls: list[tuple]) -> list[tuple[bool, object]]:
        """calls: (key, "open" | "step" | "close", payload) -> per call (True, value) or (False, error text).

        open: payload = the example's fields; value = reset()'s messages. step: payload = the assistant's
        text; value = {"messages", "done", "reward"}. close: forget the environment."""
        results: list = [None] * len(calls)
        queues = [deque() for _ in self.workers]
        for idx, (key, method, _) in enumerate(calls):
            if method == "open":
                load = [0] * len(self.workers)
                for s in self.slot.values():
                    load[s] += 1
                self.slot[key] = load.index(min(load))
                self.history[key] = []
                self.broken.pop(key, None)
            if key not in self.slot:
                results[idx] = (True, None) if method == "close" else (False, "no environment open for this trajectory")
                continue
            queues[self.slot[key]].append((idx, *calls[idx]))
        busy: dict[int, tuple] = {}  # process index -> (queue entry, deadline)
        while any(queues) or busy:
            for i, w in enumerate(self.workers):
                if i in busy or not w.ready:
                    continue
                if i in self._pending_replays:  # rebuild the environments this process lost, in call order
                    replay = [(None, k, m, p) for k in self._pending_replays.pop(i) for m, p in self.history[k]]
                    queues[i].extendleft(reversed(replay))
                while queues[i]:
                    entry = queues[i].popleft()
                    idx, key, method, payload = entry
                    if key in self.broken and method != "close":
                        if idx is not None:
                            results[idx] = (False, self.broken[key])
                        continue
                    w.conn.send((key, method, payload))
                    busy[i] = (entry, time.monotonic() + self.timeout_s)
                    break
            self._poll(busy, results)
        for key, method, _ in calls:
            if method == "close":
                self.slot.pop(key, None)
                self.history.pop(key, None)
                self.broken.pop(key, None)
        return results

    def _poll(self, busy: dict, results: list) -> None:
        wait_s = min((dl for _, dl in busy.values()), default=time.monotonic() + 0.1) - time.monotonic()
        by_conn = {w.conn: i for i, w in enumerate(self.workers)}
        for conn in wait_connections(list(by_conn), timeout=min(max(wait_s, 0.0), 0.5)):
            i = by_conn[conn]
            w = self.workers[i]
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                w.proc.join(1)  # reaped, so its exit code is known
                if i in busy:
                    (idx, key, _, _), _ = busy.pop(i)
                    self._fail(idx, key, f"environment process died (exit code {w.proc.exitcode})", results)
                    self._replace(i, key)
                else:
                    self._replace(i, None)
                continue
            if msg[0] == "ready":
                w.ready, w.load_errors = True, msg[1]
                continue
            if i not in busy:
                continue
            (idx, key, method, payload), _ = busy.pop(i)
            ok, value = msg[2], msg[3]
            if ok and method in ("open", "step"):
                self.history[key].append((method, payload))
            if not ok:
                self._fail(idx, key, value, results)
            elif idx is not None:
                results[idx] = (True, value)
        now = time.monotonic()
        for i, ((idx, key, method, _), deadline) in list(busy.items()):
            if now > deadline:
                busy.pop(i)
                self._fail(idx, key, f"{method} timed out after {self.timeout_s:g}s", results)
                self._replace(i, key)

    def _fail(self, idx, key, error: str, results: list) -> None:
        if idx is None:  # a replay failed: the environment cannot be rebuilt
            error = f"environment lost when its process was replaced (replaying it failed: {error})"
        self.broken[key] = error
        if idx is not None:
            results[idx] = (False, error)

    def close(self) -> None:
        close_workers(self.workers)
        self.workers = []
