"""The isolated processes that run environment code (actors/multiturn/envs.py has the contract and the checks).

`EnvPool(spec, num_procs, timeout_s).run(calls)` serves one batch of calls, e.g. the step of every
live trajectory. Each environment (a key: the caller's trajectory id) lives in one process, chosen
at its "open". Inside a process every call runs in a thread of its own, so the calls of a batch run
concurrently and each has its own deadline, `timeout_s` after it was sent: a batch whose every
call hangs takes `timeout_s`, not `timeout_s` times the calls a process holds (which, with the
calls served one after another, was minutes of silence for a hanging environment).

A call that raises, breaks the contract, passes its deadline or loses its process fails *its*
trajectory only. A process with a call past its deadline holds a stuck thread: it takes no new
calls, and once its other calls are answered (or past their own deadlines) it is killed and
replaced; its environments that were still fine are rebuilt in the new process by replaying
their calls (constructor, reset, steps) before their next call.

While calls are outstanding the pool prints a line every `progress_every_s` (what it waits on,
how many calls are done and how many timed out): a slow or hanging environment is never silent.
The processes run threads, so environment code must tolerate running beside other instances of
itself in one process (separate instances; module-level state is shared).

Deliberately light: no torch import, so the processes start fast.
"""
from __future__ import annotations

import multiprocessing as mp
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_connections

from actors.multiturn.envs import check_messages, check_step, load_env_class
from actors.runtime.worker_process import STARTUP_TIMEOUT_S, WorkerProcess, close_workers

PROGRESS_EVERY_S = 25.0  # under 30 s, with room for the line's trip through Ray's log forwarding


def _env_main(conn, specs: list[str]) -> None:
    """Load the environment class, say "ready", then answer (key, method, payload) calls, each in a
    thread of its own (answers go back as they finish, tagged with the key)."""
    (spec,) = specs
    try:
        cls, error = load_env_class(spec), None
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        cls, error = None, f"{type(e).__name__}: {e}"
    conn.send(("ready", {spec: error} if error else {}))
    envs: dict = {}
    send_lock = threading.Lock()

    def answer(key, method, payload) -> None:
        try:
            if method == "open":
                envs[key] = cls(**payload)
                value = check_messages(envs[key].reset(), "reset()")
            elif method == "step":
                value = check_step(envs[key].step(payload))
            else:  # close
                envs.pop(key, None)
                value = None
            out = ("result", key, True, value)
        except BaseException as e:  # noqa: BLE001 - environment code may raise anything
            out = ("result", key, False, f"{type(e).__name__}: {e}"[:500])
        with send_lock:
            try:
                conn.send(out)
            except (OSError, ValueError):  # the parent is gone
                pass

    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        # Every answer from a thread of its own, a close's too: this loop must keep reading while answers
        # wait for the pool to read them (the pool sends a whole batch before it reads, and a batch's
        # answers can outgrow the pipe's buffer; a blocked reader here would block both sides for good).
        threading.Thread(target=answer, args=msg, daemon=True, name=f"env-{msg[0]}").start()


@dataclass
class _Batch:
    """One `run`: per key the calls still to send, in order (replays first), and what came back."""

    results: list
    chains: dict = field(default_factory=dict)  # key -> deque of (result index or None for a replay, method, payload)
    in_flight: dict = field(default_factory=dict)  # key -> (process index, entry, deadline)
    timed_out: int = 0
    done: int = 0


class EnvPool:
    """Environments in `num_procs` processes; `run` serves one batch of calls, each bounded by `timeout_s`."""

    def __init__(self, spec: str, num_procs: int, timeout_s: float, progress_every_s: float = PROGRESS_EVERY_S,
                 log=None):
        self.spec, self.timeout_s, self.progress_every_s = spec, timeout_s, progress_every_s
        self.log = log or (lambda text: print(text, file=sys.stderr, flush=True))
        self.ctx = mp.get_context("spawn")  # forking a process that holds threads (Ray, vLLM) is unsafe
        self.workers = [self._start() for _ in range(num_procs)]
        self.slot: dict = {}  # key -> process index
        self.history: dict = {}  # key -> the calls that built its current state (replayed after a restart)
        self.broken: dict = {}  # key -> why its environment is gone
        self.needs_replay: set = set()  # keys whose process was replaced: rebuilt before their next call
        self.doomed: set[int] = set()  # processes holding a call past its deadline: replaced once idle
        self.replaced = 0
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

    # ------------------------------------------------------------------ one batch
    def run(self, calls: list[tuple]) -> list[tuple[bool, object]]:
        """calls: (key, "open" | "step" | "close", payload), at most one per key -> per call (True, value)
        or (False, error text).

        open: payload = the example's fields; value = reset()'s messages. step: payload = the assistant's
        text; value = {"messages", "done", "reward"}. close: forget the environment."""
        b = _Batch(results=[None] * len(calls))
        load = [0] * len(self.workers)  # environments per process, kept up to date as opens are placed
        for s in self.slot.values():
            load[s] += 1
        for idx, (key, method, payload) in enumerate(calls):
            if method == "open":  # on the least loaded process (counted before a reopened key leaves its own)
                old, new = self.slot.get(key), load.index(min(load))
                if old is not None:
                    load[old] -= 1
                self.slot[key], load[new] = new, load[new] + 1
                self.history[key] = []
                self.broken.pop(key, None)
                self.needs_replay.discard(key)
            if key not in self.slot:
                b.results[idx] = (True, None) if method == "close" else (False, "no environment open for this trajectory")
                b.done += 1
                continue
            b.chains[key] = deque([(idx, method, payload)])
        started, next_line = time.monotonic(), time.monotonic() + self.progress_every_s
        while b.chains or b.in_flight:
            self._send(b)
            self._receive(b)
            self._expire(b)
            self._replace_idle_doomed(b)
            if time.monotonic() >= next_line and (b.chains or b.in_flight):
                self.log(self._progress(b, calls, time.monotonic() - started))
                next_line = time.monotonic() + self.progress_every_s
        for key, method, _ in calls:
            if method == "close":
                self.slot.pop(key, None)
                self.history.pop(key, None)
                self.broken.pop(key, None)
                self.needs_replay.discard(key)
        return b.results

    def _send(self, b: _Batch) -> None:
        """Send the next call of every key that has none in flight, to a live process that takes calls."""
        for key in list(b.chains):
            if key in b.in_flight:
                continue
            i = self.slot[key]
            w = self.workers[i]
            if not w.ready or i in self.doomed:
                continue  # a new process still starting, or a doomed one about to be replaced
            chain = b.chains[key]
            if key in self.needs_replay:  # its process was replaced: rebuild it there first, in call order
                self.needs_replay.discard(key)
                if chain[0][1] == "step" and key not in self.broken:
                    chain.extendleft(reversed([(None, m, p) for m, p in self.history[key]]))
                    self.history[key] = []  # the replays record it again as they succeed
            idx, method, payload = entry = chain.popleft()
            if not chain:
                del b.chains[key]
            if key in self.broken and method != "close":
                self._settle(b, idx, (False, self.broken[key]))
                continue
            w.conn.send((key, method, payload))
            b.in_flight[key] = (i, entry, time.monotonic() + self.timeout_s)

    def _receive(self, b: _Batch) -> None:
        deadline = min((dl for _, _, dl in b.in_flight.values()), default=time.monotonic() + 0.1)
        by_conn = {w.conn: i for i, w in enumerate(self.workers)}
        for conn in wait_connections(list(by_conn), timeout=min(max(deadline - time.monotonic(), 0.0), 0.5)):
            # Every message already waiting, not one per pass of run()'s loop: each pass also walks the batch's
            # calls (send, expire), so one message a pass made a batch cost its size squared (3,000 opens and
            # closes on one process: the driver 2.9 CPU-s, now 0.95).
            while self._take(b, by_conn[conn], conn) and conn.poll():
                pass

    def _take(self, b: _Batch, i: int, conn) -> bool:
        """Read and apply one message of process `i`; False when the process is gone (then replaced)."""
        w = self.workers[i]
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            w.proc.join(1)  # reaped, so its exit code is known
            if not w.ready:  # the class loaded before, so a respawn would die the same way
                raise RuntimeError(f"an environment process died while starting (loading {self.spec}, "
                                   f"exit code {w.proc.exitcode})") from None
            for key, (j, entry, _) in list(b.in_flight.items()):
                if j == i:
                    del b.in_flight[key]
                    self._fail(b, key, entry, f"environment process died (exit code {w.proc.exitcode})")
            self._replace(i)
            return False
        if msg[0] == "ready":
            w.ready, w.load_errors = True, msg[1]
            return True
        _, key, ok, value = msg
        if key not in b.in_flight or b.in_flight[key][0] != i:
            return True  # the answer to a call that already timed out
        _, (idx, method, payload), _ = b.in_flight.pop(key)
        if not ok:
            self._fail(b, key, (idx, method, payload), value)
            return True
        if method in ("open", "step"):
            self.history[key].append((method, payload))
        if idx is not None:
            self._settle(b, idx, (True, value))
        return True

    def _expire(self, b: _Batch) -> None:
        now = time.monotonic()
        for key, (i, entry, deadline) in list(b.in_flight.items()):
            if now > deadline:
                del b.in_flight[key]
                b.timed_out += 1
                self._fail(b, key, entry, f"{entry[1]} timed out after {self.timeout_s:g}s")
                self.doomed.add(i)  # its thread is stuck in the environment's code

    def _replace_idle_doomed(self, b: _Batch) -> None:
        busy = {i for i, _, _ in b.in_flight.values()}
        for i in sorted(self.doomed - busy):
            self._replace(i)

    def _replace(self, index: int) -> None:
        """Kill process `index`, start a new one; its environments that are still fine are rebuilt there
        (by replaying their calls) before their next call."""
        self.workers[index].kill()
        self.workers[index] = self._start()
        self.doomed.discard(index)
        self.replaced += 1
        self.needs_replay |= {k for k, s in self.slot.items() if s == index and k not in self.broken}

    def _fail(self, b: _Batch, key, entry: tuple, error: str) -> None:
        idx = entry[0]
        if idx is None:  # a replay failed: the environment cannot be rebuilt
            error = f"environment lost when its process was replaced (replaying it failed: {error})"
        self.broken[key] = error
        self.needs_replay.discard(key)
        if idx is not None:
            self._settle(b, idx, (False, error))
        for later in b.chains.pop(key, ()):  # the call this replay was rebuilding for
            if later[0] is not None:
                self._settle(b, later[0], (False, error))

    @staticmethod
    def _settle(b: _Batch, idx, result: tuple) -> None:
        if idx is not None:
            b.results[idx] = result
            b.done += 1

    def _progress(self, b: _Batch, calls: list, waited: float) -> str:
        methods = sorted({entry[1] for _, entry, _ in b.in_flight.values()}) or ["process restarts"]
        return (f"environment {self.spec}: waited {waited:.0f}s on {len(b.in_flight)} {'/'.join(methods)} call(s); "
                f"{b.done} of {len(calls)} done, {b.timed_out} timed out (rollout.env_timeout_s={self.timeout_s:g} "
                "per call, all calls at once)")

    def close(self) -> None:
        close_workers(self.workers)
        self.workers = []
