"""The reference actor after its host was lost: restarted where it fits, and said so.

The reference actor holds no state a restart loses (a frozen model), so Ray restarts it (its
`reference.max_restarts`) and runs the lost call again (`max_task_retries`): when its host dies, Ray
restarts it on a node with room (cluster/launch/placement.py) and it reloads the model. Left
alone, the driver's wait on it only said "waiting on reference actor" until the timeout. `RestartWatch`
waits on its calls instead: it looks every CHECK_EVERY_S whether the actor's host was lost (HostWatch:
"lost host ...: it held ... reference actor"), then says what it waits for (a node with room for the
actor's bundle, at most `ray.node_wait_s`), and where the actor came back; `on_back` gives the new
process its threads and updates placement.json. The call it waited on then completes on the new actor,
or, when Ray's own retries of it ran out (each failing at once on a refused connection, before Ray marked
the host dead, or still going to the lost address after the actor was back elsewhere), is sent again there.

Ray also restarts the actor in place, on its live host, when only its process died, and runs the call
again there: nothing fails, so nothing would tell the driver. Each answer names the process that gave
it (`answered_by`); a new one is said and handed to `on_back` like an actor back from a lost host (its
threads again, its new process in placement.json).
"""
from __future__ import annotations

import time
from collections.abc import Callable

from actors.runtime.waits import WAITING_LINE_EVERY_S, ActorFailed, actor_error, no_answer, say_waiting, wait_for
from cluster.launch.hosts import HostWatch
from cluster.launch.waits import HOST_DEATH_WAIT_S

CHECK_EVERY_S = 5.0  # how often a wait looks for a lost host (a node table read)
ROOM_LINE_EVERY_S = 30.0  # how often a wait for a node with room says so again


class RestartWatch:
    """Waits on restartable actors' calls (by their names as errors give them: "reference actor")."""

    def __init__(self, hosts: HostWatch, node_wait_s: float, bundles: dict[str, dict],
                 on_back: Callable[[str, dict], None], pids: dict[str, int] | None = None):
        """`bundles`: each actor's placement-group bundle ({"CPU": 0.25}), named when it waits for room;
        `on_back(name, info)`: the actor runs in a new process (its info() answer), on another node or its own;
        `pids`: each actor's process at start (placement.json)."""
        self.hosts, self.node_wait_s, self.bundles, self.on_back = hosts, node_wait_s, bundles, on_back
        self.pids: dict[str, int] = dict(pids or {})
        self._looked = -CHECK_EVERY_S  # when a wait last read the node table (at most every CHECK_EVERY_S)

    def wait(self, call: Callable, handle, name: str, what: str, timeout_s: float):
        """ray.get(call()), like actors.runtime.waits.wait_for, but a lost host of the actor is said and waited
        out (bounded by ray.node_wait_s), after which `timeout_s` starts again for the call run anew.

        `call()` sends the call (again: Ray's own retries of it may run out before Ray has marked the
        actor's host dead, each failing at once on a connection refused)."""
        import ray
        from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

        ref = call()
        t0 = said = time.monotonic()
        sent_before_restart = False  # `ref` went to the process lost with its host (Ray's retries of it may fail)
        while True:
            # Also before the call's first wait: Ray may have restarted the actor between two calls already.
            if time.monotonic() - self._looked >= CHECK_EVERY_S:
                self._looked = time.monotonic()
                if self.hosts.host_lost(name):  # said once per host ("lost host ...: it held ...")
                    self._await_restart(handle, name)
                    t0 = said = time.monotonic()
                    sent_before_restart = True
            left = timeout_s - (time.monotonic() - t0)
            try:
                return ray.get(ref, timeout=max(0.0, min(left, CHECK_EVERY_S)))
            except GetTimeoutError:
                if left <= CHECK_EVERY_S:
                    raise no_answer(name, what, timeout_s) from None
            except RayActorError as e:
                # Sent again, to the live actor, when its connection broke and either the actor is already back
                # elsewhere (Ray's retries of the call still went to the lost process's address and ran out: seen in
                # the lost-host test, "failed to connect ... <the old host>") or its host is found lost now.
                if not (isinstance(e, ActorUnavailableError) and (sent_before_restart or self._host_found_lost(name))):
                    raise ActorFailed(name, what, died=True, detail=actor_error(e)) from e
                if not sent_before_restart:  # its host found lost just now: the actor is not back yet
                    self._await_restart(handle, name)
                ref, sent_before_restart = call(), False
                t0 = said = time.monotonic()
                continue
            if time.monotonic() - said >= WAITING_LINE_EVERY_S:
                said = time.monotonic()
                say_waiting(name, what, said - t0, timeout_s)

    def answered_by(self, name: str, handle, pid: int, timeout_s: float) -> None:
        """`pid` answered `name`'s call: a process other than the one known means Ray restarted the actor (its
        process died; a lost host is handled in `wait`) and ran the call again. Said, and handed to `on_back`."""
        known = self.pids.setdefault(name, pid)
        if known == pid:
            return
        self.pids[name] = pid
        info = wait_for(handle.info.remote(), name, "answering after its restart", timeout_s)
        self.hosts.place(name, info.get("node_id"))
        print(f"{name} was restarted (process {known} -> {pid}) on {self.hosts.describe(name)}; Ray ran its call "
              "again, nothing was skipped", flush=True)
        self.on_back(name, info)

    def _host_found_lost(self, name: str) -> bool:
        """Its connection broke: whether Ray marks the actor's host dead within HOST_DEATH_WAIT_S."""
        deadline = time.monotonic() + HOST_DEATH_WAIT_S
        while time.monotonic() < deadline:
            if self.hosts.host_lost(name):
                return True
            time.sleep(2.0)
        return False

    def _await_restart(self, handle, name: str) -> None:
        """Until Ray has restarted `name` on a live node (it answers info()), saying what it waits for."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        bundle = ", ".join(f"{n:g} {kind}" for kind, n in self.bundles.get(name, {}).items()) or "its bundle"
        print(f"{name} was lost with its host: Ray restarts it on a node with room for {bundle} and runs its "
              f"call again; waiting for it, at most ray.node_wait_s={self.node_wait_s:.0f}s ({self.hosts.room_note(fresh=True)})",
              flush=True)
        t0 = said = time.monotonic()
        ref = handle.info.remote()  # queued by Ray until the actor is alive again
        while True:
            left = self.node_wait_s - (time.monotonic() - t0)
            try:
                info = ray.get(ref, timeout=max(0.0, min(left, ROOM_LINE_EVERY_S)))
                break
            except GetTimeoutError:
                if left <= ROOM_LINE_EVERY_S:
                    raise ActorFailed(name, "restarting after its host was lost", died=True,
                                      detail=f"not back within ray.node_wait_s={self.node_wait_s:.0f}s: no node with "
                                      f"room for {bundle} ({self.hosts.room_note(fresh=True)}); add a node") from None
            except RayActorError as e:
                raise ActorFailed(name, "restarting after its host was lost", died=True, detail=actor_error(e)) from e
            said = time.monotonic()
            print(f"waiting for a node with room for the {name} ({bundle}): {said - t0:.0f}s so far, at most "
                  f"ray.node_wait_s={self.node_wait_s:.0f}s ({self.hosts.room_note(fresh=True)})", flush=True)
        self.hosts.place(name, info.get("node_id"))
        self.pids[name] = info.get("pid")  # its answers come from this process now: no second report
        self.on_back(name, info)
        print(f"{name} restarted on {self.hosts.describe(name)} {time.monotonic() - t0:.0f}s after its host was "
              "lost; its call runs again there", flush=True)

