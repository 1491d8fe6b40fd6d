"""An isolated process for user code (reward functions, environments), whose parent is not ours.

User code runs with the user's rights: it is isolated from raygrpo's processes, not sandboxed.
What the isolation guarantees is that the usual ways a function can reach "its parent" reach no
raygrpo process:

    driver (or rollout actor)
      └─ keeper   spawned; its own process group; holds no state of the run
           └─ worker   forked by the keeper; runs the user code; dies with the keeper

- `os.kill(os.getppid(), ...)` in user code signals the keeper. The worker dies with it (Linux
  PR_SET_PDEATHSIG), the caller sees the worker's pipe close and replaces it: one call fails.
- `os.killpg(0, ...)` / a signal to the process group reaches the keeper, the worker and whatever
  the user code started, never the driver (the keeper runs in a group of its own; so Ctrl-C at a
  terminal reaches the driver alone, which then shuts the workers down).
- The keeper mirrors the worker's end: it exits with the worker's exit code, or dies of the same
  signal, so `proc.exitcode` is the worker's (e.g. -9 after SIGKILL, 3 after `os._exit(3)`).
- If the driver dies, the keeper notices within a second and kills its group.

What it does not guard against: code that looks up raygrpo's processes by name or pid and signals
them, `kill(-1, ...)`, or anything else the user's rights allow (see README, "Trust model").

Deliberately light: no torch import, so these processes start fast.
"""
from __future__ import annotations

import ctypes
import os
import resource
import select
import signal
import sys
import time
import traceback
from collections.abc import Callable

STARTUP_TIMEOUT_S = 120.0
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent (the keeper) exits."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the keeper still takes its group down when the driver goes
        pass


def _run_worker(conn, specs, target: Callable) -> int:
    """The forked worker's life: target(conn, specs); returns the exit code."""
    try:
        target(conn, specs)
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - the traceback goes to stderr, the code to the keeper
        traceback.print_exc()
        return 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass


def _wait(pid: int, driver: int) -> int:
    """Wait for the worker `pid` to end; returns its exit code (-N: killed by signal N). If the
    driver goes away first, kill this process group (the worker and what it started, this keeper too)."""
    fd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None  # readable once the worker has ended
    while True:
        if fd is None:
            time.sleep(0.05)
        else:
            select.select([fd], [], [], 1.0)
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if os.getppid() != driver:
            os.killpg(0, signal.SIGKILL)


def _keeper_main(conn, specs, target: Callable, driver: int) -> None:
    """Runs in the spawned keeper: its own process group, fork the worker, then mirror its end."""
    os.setpgid(0, 0)
    pid = os.fork()
    if pid == 0:
        _die_with_parent()
        if os.getppid() == 1:  # the keeper died before the line above: nobody to serve
            os._exit(1)
        os._exit(_run_worker(conn, specs, target))
    conn.close()  # the worker holds its end: the caller sees EOF as soon as the worker is gone
    code = _wait(pid, driver)
    if code < 0:  # die of the same signal, so proc.exitcode reads like the worker's own
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1)  # a signal whose default is not to terminate: fall through
    os._exit(code if 0 <= code < 256 else 1)


class WorkerProcess:
    """One isolated worker (under its keeper) and the caller's end of its pipe. `target(conn, specs)`
    runs in the worker: the reward loop (actors/rewards/pool.py) or the environment loop (actors/multiturn/env_pool.py).

    `proc` is the keeper; its `exitcode` after `join` is the worker's exit code."""

    def __init__(self, ctx, specs, target: Callable, name: str = "raygrpo-worker"):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_keeper_main, args=(child, specs, target, os.getpid()), daemon=True, name=name)
        self.proc.start()
        child.close()
        self.ready = False
        self.started = time.monotonic()
        self.load_errors: dict[str, str] = {}
        self.batched: dict[str, bool] = {}
        self.names: dict[str, str] = {}

    def kill(self) -> None:
        """Kill the keeper's whole group (keeper, worker, anything the user code started)."""
        if self.proc.is_alive():
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # the keeper has not made its group yet
                self.proc.kill()
        self.proc.join(5)
        self.conn.close()

    def exitcode(self, wait_s: float = 1.0) -> int | None:
        """The worker's exit code once it is gone (None if it does not end within `wait_s`)."""
        self.proc.join(wait_s)
        return self.proc.exitcode


def close_workers(workers: list[WorkerProcess]) -> None:
    """Ask each worker to exit (None on its pipe), give it a moment, then make sure it is gone."""
    for w in workers:
        try:
            w.conn.send(None)
        except (OSError, BrokenPipeError):
            pass
    for w in workers:
        w.proc.join(1)
        w.kill()
