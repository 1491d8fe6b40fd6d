"""Stopping a run on request (SIGTERM from SLURM or Kubernetes, SIGINT from Ctrl-C) without losing work.

The first signal asks the driver to stop at the next step boundary: it saves a checkpoint there
and raises `RunStopped`. If the boundary is not reached within `trainer.stop_grace_s` (schedulers
send SIGKILL ~30 s after SIGTERM), or a second signal comes, or the run is not yet training, the
driver is interrupted at once (`Interrupted`, a KeyboardInterrupt) and the last complete checkpoint
is what a rerun resumes from. Either way the CLI exits with 128 + the signal number.
"""
from __future__ import annotations

import _thread
import signal
import sys
import threading
import time


class Interrupted(KeyboardInterrupt):
    """Stopped at once (no checkpoint on the way out)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


class RunStopped(RuntimeError):
    """Stopped at a step boundary after a checkpoint was saved."""

    def __init__(self, signum: int, step: int, checkpoint: str):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; checkpoint {checkpoint} saved; "
                         "run the same command again to resume from it")


class StopSignals:
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.signum: int | None = None  # the signal that asked to stop
        self.asked_at: float | None = None  # time.monotonic() of that signal
        self.armed = False  # True while training: a stop can wait for the step boundary
        self._old: dict = {}
        self._timer: threading.Timer | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def grace_left(self, at_least_s: float = 1.0) -> float:
        """Seconds of trainer.stop_grace_s left since the first signal (at least `at_least_s`): how long the way
        out may still wait on an actor."""
        if self.asked_at is None:
            return self.grace_s
        return max(at_least_s, self.grace_s - (time.monotonic() - self.asked_at))

    def install(self) -> None:
        """Take over SIGTERM and SIGINT (after ray.init, which sets its own SIGTERM handler)."""
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in self.SIGNALS:
            old = signal.signal(sig, self._handle)
            self._old.setdefault(sig, old)

    def restore(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}

    def _handle(self, signum, frame) -> None:
        if self.asked_at is None:
            self.asked_at = time.monotonic()
        if self.requested or not self.armed or self.grace_s <= 0:
            self.signum = self.signum or signum
            raise Interrupted(self.signum)
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: stopping after this step with a checkpoint (at most "
              f"{self.grace_s:g} s, trainer.stop_grace_s; send it again to stop at once)", file=sys.stderr, flush=True)
        # the grace period ends by "signalling" the main thread again, which then stops at once
        self._timer = threading.Timer(self.grace_s, _thread.interrupt_main)
        self._timer.daemon = True
        self._timer.start()
