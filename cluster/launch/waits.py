"""Bounded waits on actors: nothing the driver does blocks forever.

Every wait on an actor goes through `wait_for` (actors/runtime/waits.py: the reward scorer waits on
its reward-model actors with it too) or `wait_all` for a group, such as the learner ranks, which
fails on the first actor that fails; each has a timeout and, when it runs out or the actor dies,
raises ActorFailed, which names the actor and what it was doing. `wait_restarted`
waits for Ray to bring a dead worker back, or says why it will not.
"""
from __future__ import annotations

import time

from actors.runtime.waits import (
    WAITING_LINE_EVERY_S,
    ActorFailed,
    actor_died,
    actor_error,
    actor_table_entry,
    drain,
    no_answer,
    say_waiting,
    wait_for,
)

# After one actor of a group fails with an error, how long the others may take to show that one of
# them died: a rank whose collective lost its peer raises too, and the dead peer is the cause. A peer
# whose whole host was lost shows as dead only once Ray marks the node dead (its raylet died with it),
# after the missed heartbeats, ~15-30 s with Ray's defaults.
PEER_DEATH_GRACE_S = 45.0


class PeerLost(ActorFailed):
    """The actors waited on cannot finish: a peer they exchange data with was lost with its host, and
    their transfer would only end at its own timeout. Counted as their death (they are restarted)."""

    def __init__(self, actor: str, what: str, detail: str):
        super().__init__(actor, what, died=True, detail=detail)


WATCH_EVERY_S = 5.0  # how often wait_all's `watch` looks for a lost peer


def wait_all(refs: list, actors: list[str], what: str, timeout_s: float, watch=None) -> list:
    """The results of one call per actor (`actors` names them), failing on the first actor that
    dies or raises, not in list order: ranks that sit in a collective with a dead peer would
    otherwise hold the wait until the timeout, and their timeout would hide the death.
    `watch()`: called every WATCH_EVERY_S while waiting; a text it returns (a peer of theirs was lost
    with its host) raises PeerLost naming the first actor, with that text."""
    import ray

    t0, pending, results = time.monotonic(), list(refs), {}
    deadline, said = t0 + timeout_s, t0
    while pending:
        left = deadline - time.monotonic()
        step = min(left, WAITING_LINE_EVERY_S, WATCH_EVERY_S if watch else WAITING_LINE_EVERY_S)
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, step))
        if not ready:
            if left <= step:
                raise no_answer(actors[refs.index(pending[0])], what, timeout_s)
            lost = watch() if watch else None
            if lost:
                drain(pending, f"{what} (given up on: {lost})", timeout_s)
                raise PeerLost(actors[0] if len(actors) == 1 else f"{actors[0]} (and the other ranks)", what, lost)
            if time.monotonic() - said >= WAITING_LINE_EVERY_S:
                said = time.monotonic()
                say_waiting(", ".join(actors[refs.index(r)] for r in pending), what, said - t0, timeout_s)
            continue
        try:
            results[refs.index(ready[0])] = ray.get(ready[0])
        except Exception as e:
            if actor_died(e):
                raise ActorFailed(actors[refs.index(ready[0])], what, died=True, detail=actor_error(e)) from e
            # An error of its own, or its collective lost a peer: if a peer died, that is the cause.
            grace_end = time.monotonic() + PEER_DEATH_GRACE_S
            while pending and time.monotonic() < grace_end:  # the first peer that shows it died is the cause
                done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, grace_end - time.monotonic()))
                for ref in done:
                    try:
                        ray.get(ref)
                    except Exception as peer:  # noqa: BLE001 (another rank's own error: the first one is reported)
                        if actor_died(peer):
                            raise ActorFailed(actors[refs.index(ref)], what, died=True, detail=actor_error(peer)) from peer
            raise
    return [results[i] for i in range(len(refs))]



def wait_restarted(handle, name: str, timeout_s: float, budget_key: str = "rollout.max_restarts") -> dict:
    """After a worker died, poll until Ray has restarted it, or give up with a clear error: at once
    when Ray will not restart it (its restart budget is spent), else after `timeout_s`."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            return wait_for(handle.info.remote(), name, "restarting", max(1.0, min(60.0, deadline - time.time())))
        except ActorFailed:
            state, restarts = actor_state(handle)
            if state == "DEAD":
                raise ActorFailed(name, "restarting after a crash", died=True,
                                  detail=f"it died for good: Ray restarted it {restarts} time(s), its whole restart "
                                  f"budget ({budget_key}={restarts}); raise {budget_key} (-1: unlimited) if this "
                                  "worker is expected to die now and then") from None
            time.sleep(2.0)  # still restarting (or its engine still loading)
    raise ActorFailed(name, "restarting after a crash", died=True,
                      detail=f"not back within {timeout_s:.0f}s (Ray restarts it at most rollout.max_restarts times)")


# How long a dead actor may stay ALIVE in Ray's table: when its whole host was lost, until the node is marked
# dead after its missed heartbeats (~15-30 s with Ray's defaults).
HOST_DEATH_WAIT_S = 60.0


def wait_dead(handle, name: str, timeout_s: float) -> str:
    """Wait until Ray's actor table says the actor (max_restarts=0, whose call just failed) is DEAD; returns
    its last state. Bounded, and said every WAITING_LINE_EVERY_S: a process that is alive after all is left
    to whoever kills it next."""
    t0 = time.monotonic()
    said = t0
    state, _ = actor_state(handle)
    while state not in ("DEAD", "") and time.monotonic() - t0 < timeout_s:
        time.sleep(1.0)
        state, _ = actor_state(handle)
        if time.monotonic() - said >= WAITING_LINE_EVERY_S:
            said = time.monotonic()
            print(f"waiting for Ray to say whether {name} died (its host lost?) or lives (Ray calls it {state}): "
                  f"{said - t0:.0f}s so far, at most {timeout_s:.0f}s", flush=True)
    return state


def actor_state(handle) -> tuple[str, int]:
    """(Ray's state of the actor: ALIVE | RESTARTING | DEAD | ..., restarts so far), ("", 0) if unknown.
    Read from the GCS actor table (works without the dashboard)."""
    info = actor_table_entry(handle)
    return str(info.get("State", "")), int(info.get("NumRestarts", 0))


