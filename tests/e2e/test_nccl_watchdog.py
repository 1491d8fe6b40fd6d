"""The Watchdog's reasons (actors/transport/nccl_protocol.py) without a communicator: a stand-in whose
destroy() is recorded. The e2e test (tests/e2e/test_nccl_protocol.py) drives it around vLLM's real NCCL
code on the gloo-backed stand-in; here each way a wait can end is forced, one at a time. (In the e2e tier
though it starts nothing: nccl_protocol.py imports vLLM, which the unit tier never loads.)"""
from __future__ import annotations

import threading
import time

import pytest

from actors.transport import nccl_protocol
from actors.transport.nccl_protocol import NcclWaitAborted, Watchdog


class Comm:
    def __init__(self):
        self.aborted = threading.Event()

    def destroy(self):
        self.aborted.set()


def dog(comm, **kw):
    return Watchdog(comm, who="learner rank 0", what="the weight broadcast", todo="Build it again",
                    **{"timeout_s": 0.5, **kw})


def test_a_wait_past_its_bound_is_aborted_and_names_who_was_not_done():
    comm = Comm()
    with pytest.raises(NcclWaitAborted, match=r"learner rank 0 aborted the weight broadcast after .*no answer in "
                                              r"0s from engine 1 of 2\. Build it again"):
        with dog(comm, timeout_s=0.3, unfinished=lambda: "engine 1 of 2"):
            assert comm.aborted.wait(5)  # the watchdog's abort is what ends this wait


def test_the_peers_bound_closing_the_connection_first_is_still_named_as_the_bound():
    """Under load the engines' own watchdogs (started after the sender's) can abort first: the sender's wait
    then raises a connection error before its own watchdog thread runs. Past the bound, that is the bound,
    named with the engines not done, not a bare connection error after a 5 s wait for a peer's death."""
    comm, t0 = Comm(), time.monotonic()
    with pytest.raises(NcclWaitAborted, match=r"no answer in 0s from engine 0, 1 of 2 \(RuntimeError: Connection "
                                              r"closed by peer\)"):
        with dog(comm, timeout_s=0.2, unfinished=lambda: "engine 0, 1 of 2", peer_failure=lambda: None) as d:
            d._done.set()  # the watchdog thread never ran (a starved thread)
            time.sleep(0.3)
            raise RuntimeError("Connection closed by peer")
    assert comm.aborted.is_set() and time.monotonic() - t0 < nccl_protocol.PEER_ERROR_GRACE_S


def test_a_dead_peer_is_named_over_the_bound():
    comm = Comm()
    with pytest.raises(NcclWaitAborted, match=r"engine 0 of 2: its process 7 exited with 3 \(RuntimeError: reset"):
        with dog(comm, timeout_s=0.2, peer_failure=lambda: "engine 0 of 2: its process 7 exited with 3") as d:
            d._done.set()
            time.sleep(0.3)
            raise RuntimeError("reset")


def test_an_error_within_the_bound_waits_for_the_peers_own_word(monkeypatch):
    monkeypatch.setattr(nccl_protocol, "PEER_ERROR_GRACE_S", 2.0)
    comm, asked = Comm(), []

    def peer_failure():
        asked.append(time.monotonic())
        return "engine 1 of 2 died" if len(asked) > 3 else None

    with pytest.raises(NcclWaitAborted, match=r"engine 1 of 2 died \(RuntimeError: reset\)"):
        with dog(comm, timeout_s=30, peer_failure=peer_failure):
            raise RuntimeError("reset")
    assert comm.aborted.is_set()


def test_an_error_within_the_bound_without_a_peer_is_its_own_reason():
    comm = Comm()
    with pytest.raises(NcclWaitAborted, match=r"after .*s: ValueError: bad bucket\. Build it again"):
        with dog(comm, timeout_s=30):
            raise ValueError("bad bucket")
    assert comm.aborted.is_set()


def test_a_wait_that_ends_in_time_aborts_nothing():
    comm = Comm()
    with dog(comm, timeout_s=30, unfinished=lambda: "engine 0 of 1"):
        pass
    time.sleep(2 * nccl_protocol.CHECK_EVERY_S)
    assert not comm.aborted.is_set()
