"""What a slow reward phase is waiting on, said on the console at least every PROGRESS_EVERY_S seconds.

Every kind of reward (the process pool, the HTTP verifiers, the reward-model actors) counts its
calls here while a batch is scored; a ticker thread prints one line while the scoring lasts, e.g.

    rewards: 240/256 calls done, 12 timed out (35 s); waiting on slow_fn: 4 calls (reward.timeout_s=10)

Deliberately light: no torch import (the reward processes import the pool, which imports this).
"""
from __future__ import annotations

import sys
import threading
import time
from collections import Counter

PROGRESS_EVERY_S = 15.0  # the bound is 30 s of silence; half of it leaves room for a slow print


class ScoringProgress:
    """Thread-safe counts of one scoring pass, and the ticker that reports them."""

    def __init__(self, names: dict[str, str], timeout_note: dict[str, str] | None = None,
                 every_s: float = PROGRESS_EVERY_S, out=None):
        self.names, self.timeout_note = names, timeout_note or {}
        self.every_s, self.out = every_s, out
        self.total, self.done, self.timed_out = Counter(), Counter(), Counter()
        self.last_done: dict[str, float] = {}  # spec -> time.monotonic() of its last finished call
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.t0 = time.monotonic()
        self.lines = 0

    def add(self, spec: str, n: int = 1) -> None:
        with self._lock:
            self.total[spec] += n

    def finish(self, spec: str, n: int = 1, timed_out: bool = False) -> None:
        with self._lock:
            self.done[spec] += n
            self.last_done[spec] = time.monotonic()
            if timed_out:
                self.timed_out[spec] += n

    def note(self, spec: str, text: str) -> None:
        """Say something about one function now (e.g. it switched to running its calls at once)."""
        self._print(f"rewards: {self.names.get(spec, spec)} {text}")

    def line(self) -> str:
        with self._lock:
            total, done, late = sum(self.total.values()), sum(self.done.values()), sum(self.timed_out.values())
            waiting = [(s, self.total[s] - self.done[s]) for s in self.total if self.total[s] > self.done[s]]
        text = f"rewards: {done}/{total} calls done"
        if late:
            text += f", {late} timed out"
        text += f" ({time.monotonic() - self.t0:.0f} s)"
        if waiting:
            text += "; waiting on " + ", ".join(
                f"{self.names.get(s, s)}: {n} call{'s' * (n != 1)}" + (f" ({self.timeout_note[s]})" if s in self.timeout_note else "")
                for s, n in waiting)
        return text

    def _print(self, text: str) -> None:
        print(text, file=self.out or sys.stderr, flush=True)
        self.lines += 1

    def _tick(self) -> None:
        while not self._stop.wait(self.every_s):
            self._print(self.line())

    def __enter__(self) -> ScoringProgress:
        self.t0 = time.monotonic()
        self._thread = threading.Thread(target=self._tick, name="reward-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
