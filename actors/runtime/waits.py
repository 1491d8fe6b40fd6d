"""Bounded waits on actors: nothing that waits on an actor blocks forever.

`wait_for` has a timeout and, when it runs out or the actor dies, raises `ActorFailed`, which names
the actor and what it was doing. Here, not in cluster/launch/waits.py (which adds the waits on a
group and on a restart), because the reward scorer waits on its reward-model actors itself.
"""
from __future__ import annotations

import logging
import re
import sys
import threading
import time


class ActorFailed(RuntimeError):
    """An actor died or did not answer in time; `.actor` names it, `.died` tells which."""

    def __init__(self, actor: str, what: str, died: bool, detail: str = ""):
        self.actor, self.what, self.died = actor, what, died
        reason = "died" if died else "did not answer in time"
        super().__init__(f"{actor} {reason} while {what}" + (f": {detail}" if detail else ""))


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


def say_waiting(actor: str, what: str, waited: float, timeout_s: float, bound: str | None = None) -> None:
    """`bound`: what sets `timeout_s` when it is not trainer.actor_timeout_s (a fixed wait), said beside it."""
    limit = f"trainer.actor_timeout_s={timeout_s:.0f}s" if bound is None else f"{timeout_s:.0f}s ({bound})"
    print(f"waiting on {actor} ({what}): {waited:.0f}s so far, at most {limit}", file=sys.stderr, flush=True)


def wait_for(refs, actor: str, what: str, timeout_s: float, bound: str | None = None, probe=None):
    """ray.get with a timeout, saying every WAITING_LINE_EVERY_S what it waits on; a dead or silent actor
    becomes ActorFailed naming it (with the actor's own error). `bound`: what sets `timeout_s` when it is not
    trainer.actor_timeout_s, so the lines do not name a key that did not set it.

    `probe`: a cheap call of the waited actor (`handle.info.remote`), sent at each waiting line. Why: a call a
    network partition caught can sit on a connection that broke without a word, lost until Ray's gRPC client
    keepalive (300 s); a call sent on that connection fails at once ("Connection reset by peer"), and the
    broken connection's calls fail with it, so the lost call is seen within a waiting line of the heal
    (docs/DESIGN.md, test_partition.py). Its answers are fetched in the background (`drain`), never waited on."""
    from ray.exceptions import GetTimeoutError, RayActorError

    try:
        return get_probing(refs, timeout_s, probe and (lambda unfinished: [probe()]), f"{actor}: a probe while {what}",
                           on_line=lambda waited: say_waiting(actor, what, waited, timeout_s, bound))
    except GetTimeoutError:
        raise no_answer(actor, what, timeout_s, bound) from None
    except RayActorError as e:
        if not actor_died(e):
            raise
        raise ActorFailed(actor, what, died=True, detail=actor_error(e)) from e


def get_probing(refs, timeout_s: float | None, probe, what: str, on_line=None):
    """ray.get(refs) within `timeout_s` (None: no bound; Ray's GetTimeoutError past it). At each
    WAITING_LINE_EVERY_S: `on_line(seconds waited)` (wait_for says the waiting line there), then
    `probe(unfinished)` (the indices of the calls not done, [0] for a single ref; it returns the probe calls it
    sent), for the reason `wait_for`'s probe has; None sends none. The learner's wait on the engines'
    weight-update calls uses it directly. The probes' ends are drained (`what` names them in the log)."""
    import ray
    from ray.exceptions import GetTimeoutError

    t0, probes = time.monotonic(), []
    try:
        while True:
            left = None if timeout_s is None else timeout_s - (time.monotonic() - t0)
            try:
                return ray.get(refs, timeout=WAITING_LINE_EVERY_S if left is None else
                               max(0.0, min(left, WAITING_LINE_EVERY_S)))
            except GetTimeoutError:
                if left is not None and left <= WAITING_LINE_EVERY_S:
                    raise
                if on_line is not None:
                    on_line(time.monotonic() - t0)
                if probe is not None:
                    probes += probe(calls_not_done(refs))
    finally:
        if probes:
            drain(probes, what, WAITING_LINE_EVERY_S)


def calls_not_done(refs) -> list[int]:
    """The indices of the calls in `refs` not done yet; [0] for a single ref (its ray.get just timed out)."""
    import ray

    if not isinstance(refs, list):
        return [0]
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    return [i for i, ref in enumerate(refs) if ref not in done]


def drain(refs: list, what: str, timeout_s: float) -> None:
    """Calls no one waits on any more (probes; a group's calls given up on): their end is fetched in a
    background thread, at most `timeout_s` each, and logged (RUN_DIR/logs/driver.log). Left alone, Ray would
    print a failed one's error raw on the console when it is freed ("Unhandled error ... ActorUnavailableError")."""
    import ray

    def fetch() -> None:
        for ref in refs:
            try:
                ray.get(ref, timeout=timeout_s)
            except Exception as e:  # noqa: BLE001 - expected: the call failed with its peer; only logged
                logging.getLogger("raygrpo").info("%s ended: %s", what, str(e).splitlines()[-1:] or type(e).__name__)

    threading.Thread(target=fetch, name="drain", daemon=True).start()


def actor_died(e: BaseException) -> bool:
    """Whether the error of a call says the called actor died (or Ray cannot reach it). Not when the actor
    raised it from its own code (RayTaskError): Ray then gives the error the type of its cause, so a learner
    whose own call to an engine found that engine unavailable raises an ActorUnavailableError too, and
    lives."""
    from ray.exceptions import RayActorError, RayTaskError

    return isinstance(e, RayActorError) and not isinstance(e, RayTaskError)


def actor_table_entry(handle) -> dict:
    """Ray's GCS actor table entry of `handle` ("State", "NumRestarts", "Address": {"NodeID", ...}); {} when
    unreadable (an internal API, which works without the dashboard)."""
    try:
        from ray._private import state

        return state.actors(handle._actor_id.hex()) or {}
    except Exception:  # noqa: BLE001 - an internal API; callers fall back to polling or their bound
        return {}


def no_answer(actor: str, what: str, timeout_s: float, bound: str | None = None) -> ActorFailed:
    why = "raise trainer.actor_timeout_s if this machine is just slow" if bound is None else bound
    return ActorFailed(actor, what, died=False, detail=f"no answer within {timeout_s:.0f}s ({why})")


# How long a caller keeps asking an actor that Ray calls unavailable (reach_actors).
REACH_ACTORS_S = 30.0


def reach_actors(handles: list, timeout_s: float = REACH_ACTORS_S) -> None:
    """Call every actor once (its `info()`), asking again while Ray says one is unavailable.

    Why: this process's connection to an actor can be stale. A partition that healed before Ray marked the
    host dead leaves it reset, and the first call on it fails with ActorUnavailableError ("Connection reset
    by peer") although the actor lives; Ray connects anew for the next call. The weight sender calls this
    before a transfer's init, which must not be that first call: the engines that did answer it would wait
    in the group's rendezvous until its timeout. An actor that is really gone raises here, within
    `timeout_s`."""
    import ray
    from ray.exceptions import ActorUnavailableError, GetTimeoutError

    deadline = time.monotonic() + timeout_s
    for handle in handles:
        while True:
            try:
                ray.get(handle.info.remote(), timeout=max(1.0, deadline - time.monotonic()))
                break
            except ActorUnavailableError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.5)
            except GetTimeoutError:
                raise TimeoutError(f"{handle} did not answer within {timeout_s:.0f}s (its host lost?)") from None
