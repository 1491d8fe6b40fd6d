"""Running reward code in isolated worker processes, and calling a reward function safely.

User reward functions (and `math_verify`) run here, not in the driver: a call that raises,
returns a non-number / NaN, exceeds its timeout (its process is killed and replaced) or kills its
process comes back as an error for that one call, and nothing can hang the run. `WorkerProcess`,
`serve` and `close_workers` are also the shell of actors/envs.py's environment processes. The scoring
itself (forms, weights, fallbacks) is actors/rewards.py.

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
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import wait as wait_connections

from actors.reward_functions import REWARDS

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


def call_one(fn: Callable, prompt, completion: str, fields: dict) -> float:
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
    return _call_batched(fn, a, b, c) if kind == "batch" else call_one(fn, a, b, c)


def _as_reward(value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"returned {type(value).__name__} {value!r:.80}, not a number")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"returned {value}")
    return value


def is_file_spec(spec: str) -> bool:
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

    def answer(msg: tuple) -> tuple:
        idx, spec, call = msg
        try:
            return ("result", idx, True, _run_call(functions[spec], call))
        except BaseException as e:  # noqa: BLE001 - user code may raise anything, SystemExit included
            return ("result", idx, False, f"{type(e).__name__}: {e}")

    serve(conn, answer)


def serve(conn, answer: Callable[[tuple], tuple]) -> None:
    """A worker process's loop: send `answer(msg)` for every message until None arrives or the
    parent is gone (also the loop of actors/envs.py's environment processes)."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        conn.send(answer(msg))


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
