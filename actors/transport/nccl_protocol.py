"""What both halves of raygrpo's bounded `nccl` backend share (nccl_trainer.py: the sender, nccl_engine.py:
the receiver in every vLLM worker): the timeout every wait takes, the communicator's constructor, and the
watchdog that ends a wait by aborting the communicator.

vLLM's NCCL backend waits without bound: a broadcast whose peer died blocks its caller inside NCCL for
good, and the worker's init waits as long as the TCPStore and ncclCommInitRank do. NCCL's own way out is
ncclCommAbort from another thread: the kernels in flight end, the blocked call returns, and the
communicator is unusable from then on. vLLM 0.32's `PyNcclCommunicator.destroy()` is that abort (run on a
daemon thread joined for at most 5 s: pynccl.py `destroy`); `release` calls it, and `Watchdog` calls it
when a wait outlives `timeout_s` or the peer it waits for is known to have failed, and then raises
`NcclWaitAborted` naming who waited, for what, why it stopped and what to do.

Where CUDA is absent the communicator is the gloo-backed stand-in of tests/unit/gloo_nccl.py; the tests
that use it say so.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo  # noqa: TID253 (vLLM side)

from actors.runtime.background import Background

DEFAULT_TIMEOUT_S = 600.0
CHECK_EVERY_S = 0.1  # how often a watchdog looks at the clock and at the peer
PEER_ERROR_GRACE_S = 5.0  # how long a failed wait looks for the peer's own error, which names the engine


class NcclWaitAborted(RuntimeError):
    """A wait on the NCCL weight-transfer group outlived its bound or lost its peer; its communicator was
    aborted (unusable: the group must be initialised again)."""


@dataclass(kw_only=True)
class BoundedNcclInitInfo(NCCLWeightTransferInitInfo):
    """vLLM's worker-side NCCL init info, plus the bound of every wait of the worker."""

    timeout_s: float = DEFAULT_TIMEOUT_S


def communicator(group, device):
    """vLLM's NCCL communicator over a StatelessProcessGroup, as vLLM's nccl_common builds it. Read at
    call time from vLLM's module, so a stand-in put there (tests) serves this path and vLLM's alike."""
    from vllm.distributed.device_communicators import pynccl
    from vllm.utils.nccl import unpinned_nccl_env

    with unpinned_nccl_env():
        return pynccl.PyNcclCommunicator(group, device=device)


def release(comm) -> None:
    """Abort `comm` (never waits on its peers) and drop its store connection. None: nothing to do."""
    if comm is None:
        return
    try:
        comm.destroy()  # ncclCommAbort in vLLM 0.32, not ncclCommDestroy (which would wait for the peers)
    except Exception as e:  # noqa: BLE001 - a communicator being let go; say so, do not stop
        print(f"NCCL weight transfer: aborting a communicator failed ({e}); it is dropped anyway", flush=True)
    comm.group = None  # its StatelessProcessGroup: on rank 0 the TCPStore server, closed with it


def release_when_formed(join: Background) -> None:
    """For a communicator whose creation outlived its wait: abort it once it exists."""
    join.thread.join()
    release(join.result)


class Watchdog:
    """`with Watchdog(comm, who=..., what=..., timeout_s=..., peer_failure=...):` around a wait on `comm`.

    A daemon thread looks every CHECK_EVERY_S at the clock and at `peer_failure()` (a description of a
    peer that failed, or None). Past `timeout_s`, or once a peer failed, it aborts the communicator: the
    wait returns (NCCL) or raises (the stand-in). Leaving the block then raises NcclWaitAborted, also when
    the wait itself returned; a wait that raised on its own within the bound is named after the peer's
    failure if one comes within PEER_ERROR_GRACE_S (a dead engine's connection error arrives before Ray's
    word of its death), one that raised past the bound after the bound (the peers' own watchdogs ended it)."""

    def __init__(self, comm, *, who: str, what: str, timeout_s: float, todo: str,
                 peer_failure: Callable[[], str | None] | None = None,
                 unfinished: Callable[[], str | None] | None = None):
        """`unfinished()`: which peers had not finished when the time ran out (named in the reason)."""
        self.unfinished = unfinished or (lambda: None)
        self.comm, self.who, self.what, self.timeout_s, self.todo = comm, who, what, timeout_s, todo
        self.asks_peer = peer_failure is not None  # only then is a failed wait worth PEER_ERROR_GRACE_S
        self.peer_failure = peer_failure or (lambda: None)
        self.reason: str | None = None  # why it aborted; None while it has not
        self._done = threading.Event()
        self._t0 = time.monotonic()

    def __enter__(self) -> Watchdog:
        self._t0 = time.monotonic()
        threading.Thread(target=self._watch, daemon=True, name="nccl-watchdog").start()
        return self

    def _watch(self) -> None:
        while not self._done.wait(CHECK_EVERY_S):
            failure = self._peer()
            if failure is None and time.monotonic() - self._t0 <= self.timeout_s:
                continue
            self._abort(f"{failure} during the wait" if failure else self._no_answer())
            return

    def _no_answer(self) -> str:
        late = self._ask(self.unfinished)
        return f"no answer in {self.timeout_s:.0f}s" + (f" from {late}" if late else "")

    def _peer(self) -> str | None:
        return self._ask(self.peer_failure)

    @staticmethod
    def _ask(question: Callable[[], str | None]) -> str | None:
        try:
            return question()
        except Exception as e:  # noqa: BLE001 - asking about the peer failed: that is an answer too
            return f"the peer could not be asked about ({type(e).__name__}: {e})"

    def _abort(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
            release(self.comm)
            print(self.message(), flush=True)

    def message(self) -> str:
        return (f"NCCL weight transfer: {self.who} aborted {self.what} after {time.monotonic() - self._t0:.1f}s: "
                f"{self.reason}. {self.todo}")

    def __exit__(self, kind, error, tb) -> None:
        self._done.set()
        if error is not None and self.reason is None and not isinstance(error, KeyboardInterrupt):
            # Past the bound, the error is most likely the peers' own bound (their abort closes the connection;
            # under load it can reach this side before this side's watchdog thread runs): named as the bound,
            # with who was not done, and not worth the wait for a peer's death.
            past_bound = time.monotonic() - self._t0 > self.timeout_s
            deadline = time.monotonic() + (PEER_ERROR_GRACE_S if self.asks_peer and not past_bound else 0.0)
            failure = self._peer()
            while failure is None and time.monotonic() < deadline:
                time.sleep(CHECK_EVERY_S)
                failure = self._peer()
            raised = f"{type(error).__name__}: {error}"
            self._abort(f"{failure} ({raised})" if failure else f"{self._no_answer()} ({raised})" if past_bound
                        else raised)
        if self.reason is not None:
            raise NcclWaitAborted(self.message()) from error
