"""A blocking call on a daemon thread, for the weight transports' waits on a peer.

A daemon thread, not a ThreadPoolExecutor worker: a peer that hangs (a dead engine inside a gloo or NCCL
collective) must never block the interpreter's exit, which an executor's worker would.
"""
from __future__ import annotations

import threading
from collections.abc import Callable


class Background:
    """`Background(fn, *args)` starts `fn(*args)` at once; `.done`, `.result`, `.error`, `join(timeout_s)`."""

    def __init__(self, fn: Callable, *args, name: str = "transport-wait"):
        self.error: BaseException | None = None
        self.result = None
        self.thread = threading.Thread(target=self._run, args=(fn, args), daemon=True, name=name)
        self.thread.start()

    def _run(self, fn, args):
        try:
            self.result = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            self.error = e

    @property
    def done(self) -> bool:
        return not self.thread.is_alive()

    def raise_if_failed(self) -> None:
        if self.done and self.error is not None:
            raise self.error

    def join(self, timeout_s: float):
        """The call's result; TimeoutError when it is still running after `timeout_s`, its error when it failed."""
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise TimeoutError(f"weight-transfer RPC did not return in {timeout_s:.0f}s")
        self.raise_if_failed()
        return self.result
