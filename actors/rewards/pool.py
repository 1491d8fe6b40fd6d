"""Running reward code in isolated worker processes, and calling a reward function safely.

User reward functions (and `math_verify`) run here, not in the driver: each in a worker under a
keeper process of its own (actors/runtime/worker_process.py), so the function's "parent" is not the
driver. A call that raises, returns a non-number / NaN, exceeds its timeout or kills its
process comes back as an error for that one call, and nothing can hang the run. A call that
returns None means "cannot score this sample" (unscorable), which the scorer handles.

Timeouts run concurrently. A worker runs one call at a time on its main thread (so code that
is not thread-safe, or that uses signal.alarm, works as it would in TRL), each call with its
own deadline. When a function times out on at least as many calls as it finished in a batch,
it is taken for hung: its remaining calls are all sent out at once, on threads of the
workers, each with its own deadline, so a batch of 256 hanging calls costs about two
timeouts, not 256 / num_procs of them. A worker with a timed-out call is retired (its stuck
thread cannot be stopped): a fresh one takes its place at once, and the old one is killed
when its other calls have ended. The scoring itself (forms, weights, nulls) is actors/rewards/scorer.py.

Deliberately light: no torch import, so the worker processes start fast.
"""
from __future__ import annotations

import inspect
import math
import multiprocessing as mp
import numbers
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_connections

from actors.rewards.functions import REWARDS
from actors.rewards.progress import ScoringProgress
from actors.runtime.user_code import load_file_function
from actors.runtime.worker_process import STARTUP_TIMEOUT_S, WorkerProcess, close_workers

MAX_CALLS_PER_PROCESS = 256  # threads one worker runs at once for a hung function
TIMED_OUT = "timed out after"  # how a timed-out call's error text starts


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


def call_one(fn: Callable, prompt, completion: str, fields: dict) -> float | None:
    """A per-sample call, its value checked (None: the function cannot score this sample)."""
    return as_reward(fn(prompt, completion, **_accepted(fn, fields)))


def _call_batched(fn: Callable, prompts: list, completions: list, columns: dict) -> list[float | None]:
    """A TRL-style call with keywords, its values checked (one per prompt; None allowed)."""
    out = fn(**_accepted(fn, {"prompts": prompts, "completions": completions, **columns}))
    if not isinstance(out, (list, tuple)) or len(out) != len(prompts):
        raise TypeError(f"returned {type(out).__name__} {out!r:.80}, not a list of {len(prompts)} rewards")
    return [as_reward(v) for v in out]


def _run_call(fn: Callable, call: tuple):
    """call: ("one", prompt, completion, fields) or ("batch", prompts, completions, columns)."""
    kind, a, b, c = call
    return _call_batched(fn, a, b, c) if kind == "batch" else call_one(fn, a, b, c)


def as_reward(value) -> float | None:
    """A finite number as float; None stays None (unscorable); anything else raises."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"returned {type(value).__name__} {value!r:.80}, not a number or None")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"returned {value} (return None for a sample that cannot be scored)")
    return value


# --------------------------------------------------------------------------- #
# The worker: one call at a time on the main thread, a hung function's calls on threads
# --------------------------------------------------------------------------- #
def _load(spec: str) -> Callable:
    return REWARDS[spec] if spec in REWARDS else load_file_function(spec)


def _worker_main(conn, specs: list[str]) -> None:
    """Load every function once, say "ready" (load errors, which are batched, their __name__s), then
    answer calls until told to stop. ("main", ...) calls run one after another on this thread;
    ("thread", ...) calls each start a thread of their own at once."""
    functions, errors, batched, names = {}, {}, {}, {}
    for spec in specs:
        try:
            functions[spec] = _load(spec)
            batched[spec] = is_batched(functions[spec])
            names[spec] = getattr(functions[spec], "__name__", spec.rpartition(":")[2])
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            errors[spec] = f"{type(e).__name__}: {e}"
    conn.send(("ready", errors, batched, names))
    send_lock, main_calls = threading.Lock(), queue.SimpleQueue()

    def answer(idx: int, spec: str, call: tuple) -> None:
        try:
            out = ("result", idx, True, _run_call(functions[spec], call))
        except BaseException as e:  # noqa: BLE001 - user code may raise anything, SystemExit included
            out = ("result", idx, False, f"{type(e).__name__}: {e}"[:1000])
        with send_lock:
            conn.send(out)

    def receive() -> None:  # reads while the main thread is busy (or stuck) in a call
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                msg = None
            if msg is None:
                main_calls.put(None)
                return
            where, idx, spec, call = msg
            if where == "thread":
                threading.Thread(target=answer, args=(idx, spec, call), daemon=True).start()
            else:
                main_calls.put((idx, spec, call))

    threading.Thread(target=receive, name="receive", daemon=True).start()
    while (item := main_calls.get()) is not None:
        answer(*item)


@dataclass(eq=False)
class _Slot:
    """A worker and the calls it runs: {call index: (deadline, on a thread?)}."""

    worker: WorkerProcess
    inflight: dict = field(default_factory=dict)
    retired: bool = False  # a call timed out here: no new calls; killed once `inflight` is empty
    broken: bool = False  # its pipe refused a call (the worker died): no new calls; replaced once its end is read

    @property
    def main_busy(self) -> bool:
        return any(not threaded for _, threaded in self.inflight.values())


class RewardPool:
    """`num_procs` isolated workers running user reward code, with a deadline per call."""

    def __init__(self, specs: list[str], num_procs: int, timeout_s: float):
        self.specs, self.num_procs, self.timeout_s = list(specs), num_procs, timeout_s
        # spawn: forking a process that holds threads (Ray, vLLM) is unsafe.
        self.ctx = mp.get_context("spawn")
        self.slots = [self._start() for _ in range(num_procs)]
        self.replaced = 0
        self._lock = threading.Lock()  # one batch at a time (the collector and an evaluation may both score)
        self._await_ready()

    def _start(self) -> _Slot:
        return _Slot(WorkerProcess(self.ctx, self.specs, target=_worker_main, name="raygrpo-reward"))

    def _await_ready(self):
        """Wait until every worker loaded the user code; raise its load errors (bad function)."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not all(s.worker.ready for s in self.slots):
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"reward worker processes did not start in {STARTUP_TIMEOUT_S:.0f}s")
            self._poll(0.5, [], Counter(), None, [])
        first = self.slots[0].worker
        self.batched, self.names = dict(first.batched), dict(first.names)  # spec -> TRL-style? / __name__
        if first.load_errors:
            self.close()
            raise ValueError("cannot load reward function(s): " + "; ".join(f"{s}: {e}" for s, e in first.load_errors.items()))

    # ------------------------------------------------------------------ one batch
    def run(self, calls: list[tuple], progress: ScoringProgress | None = None) -> list[tuple[bool, object]]:
        """calls: (spec, call) with call as `_run_call` takes it -> per call (True, value) or (False, error)."""
        with self._lock:
            return self._run(calls, progress)

    def _run(self, calls: list[tuple], progress: ScoringProgress | None) -> list[tuple[bool, object]]:
        results: list = [None] * len(calls)
        pending, hung = list(range(len(calls))), set()
        finished, timed_out = Counter(), Counter()  # per spec, this batch
        idle_since = time.monotonic()
        while pending or any(s.inflight for s in self.slots):
            pending = self._dispatch(calls, pending, hung)
            if any(s.inflight for s in self.slots) or any(s.worker.ready and not s.retired for s in self.slots):
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > STARTUP_TIMEOUT_S:
                raise RuntimeError("no reward worker process became ready")
            deadlines = [dl for s in self.slots for dl, _ in s.inflight.values()]
            wait_s = min(deadlines, default=time.monotonic() + 0.1) - time.monotonic()
            self._poll(min(max(wait_s, 0.0), 0.5), calls, finished, progress, results)
            self._expire(calls, timed_out, progress, results)
            for spec in timed_out:
                if spec not in hung and timed_out[spec] >= max(1, finished[spec]):
                    hung.add(spec)
                    left = sum(calls[i][0] == spec for i in pending)
                    if progress is not None and left:
                        progress.note(spec, f"timed out on {timed_out[spec]} of its first {timed_out[spec] + finished[spec]} "
                                      f"calls: its other {left} run at once now, each with its own "
                                      f"{self.timeout_s:g} s deadline (reward.timeout_s)")
            self._reap()
        return results

    def _dispatch(self, calls: list[tuple], pending: list[int], hung: set) -> list[int]:
        """Send what the workers can take now; returns the calls still waiting, in their order.

        Once no worker's main thread is free and no function is hung, the rest wait without being looked at:
        a batch of per-sample calls takes about one pass of _run's loop per call, and looking at every waiting
        call in each pass made a batch cost its size squared (4,096 calls on 2 workers: 9.8 CPU-s here, 0.1
        for 256)."""
        live = [s for s in self.slots if s.worker.ready and not s.retired and not s.broken]
        free = [s for s in live if not s.main_busy]  # each takes one call on its main thread
        waiting = []
        for k, idx in enumerate(pending):
            if not free and not hung:
                waiting += pending[k:]
                break
            spec, call = calls[idx]
            if live and spec in hung:  # all at once, on threads, spread over the workers
                slot = min(live, key=lambda s: len(s.inflight))
                if len(slot.inflight) < MAX_CALLS_PER_PROCESS and self._send(slot, idx, spec, call, threaded=True):
                    continue
            elif free:
                slot = free.pop(0)
                if self._send(slot, idx, spec, call, threaded=False):
                    continue
            if any(s.broken for s in live):  # a pipe refused the call (its worker died): no more calls there
                live, free = [s for s in live if not s.broken], [s for s in free if not s.broken]
            waiting.append(idx)
        return waiting

    def _send(self, slot: _Slot, idx: int, spec: str, call: tuple, threaded: bool) -> bool:
        """False if the worker is gone (its user code killed it between two calls): the call waits for
        another worker, and _poll reads the dead one's end (exit code) and replaces it."""
        try:
            slot.worker.conn.send(("thread" if threaded else "main", idx, spec, call))
        except OSError:  # BrokenPipeError, ConnectionResetError
            slot.broken = True
            return False
        slot.inflight[idx] = (time.monotonic() + self.timeout_s, threaded)
        return True

    def _poll(self, timeout: float, calls: list, finished: Counter, progress, results: list) -> None:
        """Receive what the workers sent within `timeout` seconds (a dead one is replaced)."""
        by_conn = {s.worker.conn: s for s in self.slots}
        for conn in wait_connections(list(by_conn), timeout=max(timeout, 0.0)):
            slot = by_conn[conn]
            while True:  # every message already waiting (the threaded calls of a hung function answer together)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    self._died(slot, calls, finished, progress, results)
                    break
                if msg[0] == "ready":
                    w = slot.worker
                    w.ready, w.load_errors, w.batched, w.names = True, msg[1], msg[2], msg[3]
                elif msg[1] in slot.inflight:  # (a late answer of a timed-out call is not)
                    del slot.inflight[msg[1]]
                    results[msg[1]] = (msg[2], msg[3])
                    finished[calls[msg[1]][0]] += 1
                    if progress is not None:
                        progress.finish(calls[msg[1]][0])
                if not conn.poll():
                    break

    def _died(self, slot: _Slot, calls: list, finished: Counter, progress, results: list) -> None:
        code = slot.worker.exitcode()
        if not slot.worker.ready:  # died while importing the user code: a respawn would die the same way
            self.close()
            raise ValueError(
                f"the reward process ended while importing {', '.join(self.specs)} (exit code {code}): "
                "the module must not exit or crash when imported (e.g. sys.exit / os._exit at top level)") from None
        for idx in slot.inflight:
            results[idx] = (False, f"reward process died (exit code {code})")
            finished[calls[idx][0]] += 1
            if progress is not None:
                progress.finish(calls[idx][0])
        slot.inflight.clear()
        slot.worker.kill()
        self.slots.remove(slot)
        if not slot.retired:
            self._replace()

    def _expire(self, calls: list, timed_out: Counter, progress, results: list) -> None:
        now = time.monotonic()
        for slot in list(self.slots):
            for idx, (deadline, _) in list(slot.inflight.items()):
                if now > deadline:
                    del slot.inflight[idx]
                    results[idx] = (False, f"{TIMED_OUT} {self.timeout_s:g}s")
                    timed_out[calls[idx][0]] += 1
                    if progress is not None:
                        progress.finish(calls[idx][0], timed_out=True)
                    if not slot.retired:  # its stuck thread cannot be stopped: a fresh worker takes over now
                        slot.retired = True
                        self._replace()

    def _replace(self) -> None:
        self.slots.append(self._start())
        self.replaced += 1

    def _reap(self) -> None:
        """Kill retired workers whose calls have all ended."""
        for slot in [s for s in self.slots if s.retired and not s.inflight]:
            slot.worker.kill()
            self.slots.remove(slot)

    def close(self) -> None:
        close_workers([s.worker for s in self.slots])
        self.slots = []
