"""Bounded waits on actors: nothing the driver does blocks forever.

Every wait on an actor goes through `wait_for` (or `wait_all` for a group, such as the learner
ranks, which fails on the first actor that fails), which has a timeout and, when it runs out or
the actor dies, raises an error that names the actor and what it was doing. `wait_restarted`
waits for Ray to bring a dead worker back, or says why it will not.
"""
from __future__ import annotations

import re
import sys
import time


class ActorFailed(RuntimeError):
    """An actor died or did not answer in time; `.actor` names it, `.died` tells which."""

    def __init__(self, actor: str, what: str, died: bool, detail: str = ""):
        self.actor, self.what, self.died = actor, what, died
        reason = "died" if died else "did not answer in time"
        super().__init__(f"{actor} {reason} while {what}" + (f": {detail}" if detail else ""))


# After one actor of a group fails with an error, how long the others may take to show that one of
# them died: a rank whose collective lost its peer raises too, and the dead peer is the cause.
PEER_DEATH_GRACE_S = 10.0


# A wait longer than this says what it waits on, and says it again at this interval: a slow phase
# (an engine starting on a loaded machine, a hanging environment) is never silent.
WAITING_LINE_EVERY_S = 25.0
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def actor_error(e: BaseException) -> str:
    """The actor's own exception, from Ray's error: for an actor that raised in its constructor Ray's first
    line is only "The actor died because of an error raised in its creation task, ray::X.__init__() (pid=...)",
    and the cause (e.g. vLLM's "Unsupported CPU attention configuration: head_dim=16") is at the end of the
    traceback it carries. That exception's first and last lines; Ray's first line when there is no traceback
    (a process that was killed)."""
    lines = [line.rstrip() for line in _ANSI.sub("", str(e)).splitlines()]
    frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    if not frames:
        return lines[0] if lines else type(e).__name__
    exc = [line.strip() for line in lines[frames[-1] + 1:] if line.strip() and not line.startswith("    ")]
    if not exc:
        return lines[0]
    return exc[0] if len(exc) == 1 else f"{exc[0]} ... {exc[-1]}"


def _waiting(actor: str, what: str, waited: float, timeout_s: float) -> None:
    print(f"waiting on {actor} ({what}): {waited:.0f}s so far, at most trainer.actor_timeout_s={timeout_s:.0f}s",
          file=sys.stderr, flush=True)


def wait_for(refs, actor: str, what: str, timeout_s: float):
    """ray.get with a timeout, saying every WAITING_LINE_EVERY_S what it waits on; a dead or silent actor
    becomes ActorFailed naming it (with the actor's own error)."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    t0 = time.monotonic()
    while True:
        left = timeout_s - (time.monotonic() - t0)
        try:
            return ray.get(refs, timeout=max(0.0, min(left, WAITING_LINE_EVERY_S)))
        except GetTimeoutError:
            if left <= WAITING_LINE_EVERY_S:
                raise _no_answer(actor, what, timeout_s) from None
            _waiting(actor, what, time.monotonic() - t0, timeout_s)
        except RayActorError as e:
            raise ActorFailed(actor, what, died=True, detail=actor_error(e)) from e


def _no_answer(actor: str, what: str, timeout_s: float) -> ActorFailed:
    return ActorFailed(actor, what, died=False, detail=f"no answer within {timeout_s:.0f}s "
                       "(raise trainer.actor_timeout_s if this machine is just slow)")


def wait_all(refs: list, actors: list[str], what: str, timeout_s: float) -> list:
    """The results of one call per actor (`actors` names them), failing on the first actor that
    dies or raises, not in list order: ranks that sit in a collective with a dead peer would
    otherwise hold the wait until the timeout, and their timeout would hide the death."""
    import ray
    from ray.exceptions import RayActorError

    t0, pending, results = time.monotonic(), list(refs), {}
    deadline = t0 + timeout_s
    while pending:
        left = deadline - time.monotonic()
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, min(left, WAITING_LINE_EVERY_S)))
        if not ready:
            if left <= WAITING_LINE_EVERY_S:
                raise _no_answer(actors[refs.index(pending[0])], what, timeout_s)
            _waiting(", ".join(actors[refs.index(r)] for r in pending), what, time.monotonic() - t0, timeout_s)
            continue
        try:
            results[refs.index(ready[0])] = ray.get(ready[0])
        except RayActorError as e:
            raise ActorFailed(actors[refs.index(ready[0])], what, died=True, detail=actor_error(e)) from e
        except Exception:
            # An error of its own, or its collective lost a peer: if a peer died, that is the cause.
            done, _ = ray.wait(pending, num_returns=len(pending), timeout=PEER_DEATH_GRACE_S) if pending else ([], [])
            for ref in done:
                try:
                    ray.get(ref)
                except RayActorError as e:
                    raise ActorFailed(actors[refs.index(ref)], what, died=True, detail=actor_error(e)) from e
                except Exception:  # noqa: BLE001 (another rank's own error: the first one is reported)
                    pass
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


def actor_state(handle) -> tuple[str, int]:
    """(Ray's state of the actor: ALIVE | RESTARTING | DEAD | ..., restarts so far), ("", 0) if unknown.
    Read from the GCS actor table (works without the dashboard)."""
    try:
        from ray._private import state

        info = state.actors(handle._actor_id.hex())
        return str(info.get("State", "")), int(info.get("NumRestarts", 0))
    except Exception:  # noqa: BLE001 - an internal API; without it we fall back to polling
        return "", 0


