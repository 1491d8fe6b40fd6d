"""The rollout engines as the driver sees them: an elastic fleet, every wait bounded.

`RolloutPool` splits prompts across the engines that are live and survives losing some mid-call:
- an engine whose process died while its host lives is restarted by Ray in place; the pool brings it
  to the current weights (`on_restart`) and sends it exactly the prompts it lost (as before);
- an engine whose host was lost (Ray marked the node dead) leaves the fleet at once: its prompts go
  to the engines that survive, in the same call, so the step is neither lost nor redone. The run goes
  on while at least `rollout.min_workers` engines are live; below that it waits (ray.node_wait_s) for
  a node with room, saying so, and then fails naming what was missing;
- an engine dead past its restart budget (rollout.max_restarts), or that answers nothing within
  trainer.actor_timeout_s (hung), on a live node leaves the fleet the same way, down to rollout.min_workers
  (at it, the run fails naming the engine; issue 59);
- an engine that left comes back when Ray has placed it again (on a node with room, e.g. one that joins),
  or, hung, when it answers again; an engine an elastic start had no room for joins the same way: before it
  generates, `on_rejoin` sends it the current weights and checks their fingerprint, then it takes its share.
Prompts carry their own seeds, so which engine serves a prompt does not change its completions.
"""
from __future__ import annotations

import time

from actors.completions import PromptRollout, split_evenly
from cluster.launch.hosts import HostWatch
from cluster.launch.waits import ActorFailed, actor_state, wait_for

NODE_WAIT_LINE_EVERY_S = 30.0  # how often a wait for a node with room says so again
REJOIN_ANSWER_S = 30.0  # an engine Ray reports ALIVE again must answer info() within this
REJOIN_BOUND = "the fixed wait for an engine coming back, not trainer.actor_timeout_s"  # what its waiting line says


class RolloutPool:
    def __init__(self, handles: list, timeout_s: float, on_restart, pids: list[int | None], *, on_rejoin=None,
                 hosts: HostWatch | None = None, min_live: int | None = None, node_wait_s: float = 300.0,
                 bundle: dict | None = None, live: list[int] | None = None):
        """`on_restart(worker_index, new_process)`: a worker came back (as a new process on its host, or the
        same one answering again after its call was lost with its connection), before its prompts are
        re-sent (the driver re-syncs weights there). `on_rejoin(worker_index, info)`: a worker that left
        with its host, or never had room (an elastic start), is there (`info`: its answer to info()); the driver
        sends it the current weights (fingerprint verified) before it generates. `pids` identify the live
        processes, to notice a restart (None: not started). `hosts`: where each engine runs (the pool adds what
        it learns); `min_live`: rollout.min_workers; `bundle`: one engine's resources, named in the waits for
        a node with room; `live`: the engines that generate from the start (default: all)."""
        self.handles, self.timeout_s, self.on_restart, self.pids = handles, timeout_s, on_restart, list(pids)
        self.pid_before = list(pids)  # each engine's pid before its last revive (what on_restart's lines name)
        self.on_rejoin, self.hosts = on_rejoin, hosts or HostWatch()
        self.min_live = len(handles) if min_live is None else min_live
        self.node_wait_s, self.bundle = node_wait_s, bundle or {}
        self.live: list[int] = list(range(len(handles))) if live is None else list(live)  # the engines that generate
        self.joined: set[int] = set(self.live)  # those that ever generated (the others: an elastic start's)
        self.restarts = 0
        self.fleet_changed = False  # an engine left since the transfer group was built: rebuild before a sync
        self._asked: dict = {}  # engine -> its info() call not answered yet (rejoin)
        self._asked_once: set[int] = set()  # engines rejoin already waited REJOIN_ANSWER_S for once

    @property
    def live_handles(self) -> list:
        return [self.handles[w] for w in self.live]

    def generate(self, prompts: list, group_size: int, seeds: list[int], greedy: bool = False,
                 expected_version: int | None = None, activity: str | None = None) -> list[PromptRollout]:
        """Every prompt's rollouts, in the original order; an engine that dies loses nothing.

        A worker that died mid-call, or that answers with an older weight version than
        `expected_version` (Ray restarted it between calls: it holds the base weights), is
        brought back to the current weights and its prompts are sent again; one that left with its
        host has its prompts sent to the others. (A newer version is fine: a sync may land between the
        call being sent and served.) `activity`: what the waiting lines say ("{}": the engine's number
        of prompts), e.g. an evaluation's; None: generating.
        """
        return self._fan_out(
            len(prompts), activity or "generating {} prompts",
            lambda h, idx: h.generate.remote([prompts[i] for i in idx], group_size, [seeds[i] for i in idx], greedy),
            expected_version)

    def generate_multiturn(self, conversations: list[list[dict]], fields: list[dict], group_size: int,
                           seeds: list[int], greedy: bool = False, expected_version: int | None = None,
                           activity: str | None = None) -> list:
        """Every conversation's multi-turn rollouts (RolloutWorker.generate_multiturn), in order, with the
        same recovery as `generate`: a dead or restarted engine's share is sent again."""
        return self._fan_out(
            len(conversations), (activity or "running {} multi-turn conversations").replace("prompts", "conversations"),
            lambda h, idx: h.generate_multiturn.remote([conversations[i] for i in idx], [fields[i] for i in idx],
                                                       group_size, [seeds[i] for i in idx], greedy),
            expected_version)

    def _fan_out(self, n: int, what: str, call, expected_version: int | None) -> list:
        """`call(handle, indices)` on every live engine with its share of n items; results in item order.
        An engine that died mid-call, or answers with a weight version older than `expected_version`
        (restarted between calls: base weights), is revived and its share sent again; the share of one
        that left with its host is split among the others."""
        self.rejoin()
        pending = {w: idx for w, idx in zip(self.live, split_evenly(list(range(n)), len(self.live))) if idx}
        results: dict = {}
        while pending:
            refs = {w: call(self.handles[w], idx) for w, idx in pending.items()}
            again: dict[int, list] = {}
            orphans: list = []
            for w, ref in refs.items():
                try:
                    # probe: a generate a partition caught can be lost on a broken connection (wait_for)
                    out = wait_for(ref, f"rollout worker {w}", what.format(len(pending[w])), self.timeout_s,
                                   probe=lambda h=self.handles[w]: h.info.remote())
                except ActorFailed as e:
                    if not e.died:  # no answer within trainer.actor_timeout_s: hung, on a live node
                        self.hung(w, e)
                        orphans += pending[w]
                    elif self.recover(w):
                        again[w] = pending[w]
                    else:
                        orphans += pending[w]
                    continue
                if expected_version is not None and any(r.weight_version < expected_version for r in out):
                    self._revive(w)
                    if w in self.live:
                        again[w] = pending[w]
                    else:  # its re-sync found its host lost: it left the fleet meanwhile
                        orphans += pending[w]
                    continue
                results.update(zip(pending[w], out))
            if orphans:  # the share of engines lost with their host: to the ones that are live
                for w, idx in zip(self.live, split_evenly(sorted(orphans), len(self.live))):
                    if idx:
                        again[w] = again.get(w, []) + idx
            pending = again
        return [results[i] for i in range(n)]

    def recover_all(self, activity: str = "answering after a failed weight update") -> bool:
        """After a call failed (a weight update; pipeline mode: a call of the feeder): every live engine is
        checked; a dead one is revived or leaves the fleet with its host, one that answers as another process
        (restarted between calls) is revived. True when any engine changed (a failed update then goes again)."""
        changed = False
        for w in list(self.live):
            try:
                info = wait_for(self.handles[w].info.remote(), f"rollout worker {w}", activity, self.timeout_s)
            except ActorFailed as e:
                if not e.died:
                    self.hung(w, e)  # out of the fleet (its update goes to the others), or raised at min_workers
                else:
                    self.recover(w)
                changed = True
                continue
            if info["pid"] != self.pids[w]:  # restarted between calls
                self._revive(w, info)
                changed = True
        return changed

    def lost_with_host(self) -> list[int]:
        """The live engines whose host Ray has marked dead now (each lost host said once, HostWatch.check)."""
        lost = [a for a in self.hosts.check() if a.startswith("rollout worker ")]
        return [w for w in (int(a.rsplit(" ", 1)[1]) for a in lost) if w in self.live]

    # ------------------------------------------------------------------ a dead engine
    def recover(self, w: int) -> bool:
        """Worker w died: True once Ray restarted it in place and it was revived; False when it left
        the fleet with its host (then the fleet is at least min_live again, or this raised)."""
        name, deadline = f"rollout worker {w}", time.monotonic() + self.timeout_s
        while True:
            if w not in self.live or self.hosts.host_lost(name):
                self.leave(w)
                return False
            state, restarts = actor_state(self.handles[w])
            if state == "DEAD":
                budget = (f"died for good: Ray restarted it {restarts} time(s), its whole restart budget "
                          f"(rollout.max_restarts={restarts})")
                if len(self.live) > self.min_live:  # as an engine lost with its host (issue 59)
                    self.leave(w, f"({budget})")
                    return False
                raise ActorFailed(name, "restarting after a crash", died=True,
                                  detail=f"it {budget}, and without it fewer than rollout.min_workers={self.min_live} "
                                  "engine(s) would generate; raise rollout.max_restarts (-1: unlimited) if this worker "
                                  "is expected to die now and then, or lower rollout.min_workers") from None
            if state in ("ALIVE", ""):  # "": Ray's actor table is not readable here; ask the actor
                try:
                    info = wait_for(self.handles[w].info.remote(), name, "restarting",
                                    max(1.0, min(REJOIN_ANSWER_S, deadline - time.monotonic())), bound=REJOIN_BOUND)
                except ActorFailed:
                    info = None
                if info is not None:
                    # Reviving re-syncs the fleet's weights, and that may find w's host lost after all (a
                    # partition: the engine answered once, then its node was marked dead): then it has left.
                    self._revive(w, info)
                    return w in self.live
            if time.monotonic() > deadline:
                raise ActorFailed(name, "restarting after a crash", died=True,
                                  detail=f"not back within {self.timeout_s:.0f}s (Ray restarts it at most "
                                  "rollout.max_restarts times)")
            time.sleep(1.0)

    def _revive(self, w: int, info: dict | None = None) -> None:
        """Record worker w's new process (asking it unless `info` came from it), re-sync it."""
        name = f"rollout worker {w}"
        info = info or wait_for(self.handles[w].info.remote(), name, "restarting", self.timeout_s)
        new_process = info["pid"] != self.pids[w]
        self.pid_before[w], self.pids[w] = self.pids[w], info["pid"]
        self.hosts.place(name, info.get("node_id"))
        self.restarts += new_process
        self.on_restart(w, new_process)

    def hung(self, w: int, error: ActorFailed) -> None:
        """Worker w answered nothing within trainer.actor_timeout_s on a live node: it leaves the fleet as one lost
        with its host does, while at least min_live others generate (else `error` is raised); it rejoins, with the
        current weights verified, once it answers again (`rejoin`, which asks it without waiting)."""
        if len(self.live) <= self.min_live:
            raise error
        self.leave(w, f"(it answered nothing within {self.timeout_s:.0f}s, trainer.actor_timeout_s: hung; it rejoins "
                      "when it answers again)")

    def leave(self, w: int, why: str = "with its host") -> None:
        """Worker w's host was lost (or, `why` says, it is dead past its budget or hung): it leaves the fleet
        (below min_live this waits for room, or raises). Once: the loss may be found twice (a call of it failed,
        and the re-sync that call's recovery ran found it)."""
        if w not in self.live:
            return
        self.live.remove(w)
        self.fleet_changed = True
        print(f"rollout worker {w} left the fleet {why}: {len(self.live)} of {len(self.handles)} engine(s) "
              f"generate (rollout.min_workers={self.min_live}); its prompts go to the others", flush=True)
        if len(self.live) < self.min_live:
            self._wait_for_room()

    # ------------------------------------------------------------------ engines coming back
    def rejoin(self) -> list[int]:
        """Engines that left and that Ray has placed again (a node with room joined): each gets the current
        weights, fingerprint verified (`on_rejoin`), before it generates. Returns those that came back."""
        back = []
        for w in [w for w in range(len(self.handles)) if w not in self.live]:
            if self.handles[w] is None or actor_state(self.handles[w])[0] != "ALIVE":
                continue
            name = f"rollout worker {w}"
            # one question at a time, and an engine that left hung is not waited on: each call looks (issue 59)
            if w not in self._asked:
                self._asked[w] = self.handles[w].info.remote()
            asked = self._asked[w]
            try:
                info = wait_for(asked, name, "coming back", REJOIN_ANSWER_S if w not in self._asked_once else 0.01,
                                bound=REJOIN_BOUND)
            except ActorFailed as e:
                self._asked_once.add(w)
                if e.died:
                    self._asked.pop(w, None)
                continue  # still loading, hung, or gone again: looked at again next time
            self._asked.pop(w, None)
            self._asked_once.discard(w)
            self.pids[w] = info["pid"]
            self.hosts.place(name, info.get("node_id"))
            self.live = sorted([*self.live, w])
            self.fleet_changed = True
            self.on_rejoin(w, info)
            self.fleet_changed = False  # on_rejoin rebuilt the transfer group with it
            print(f"rollout worker {w} {'rejoined' if w in self.joined else 'joined the fleet'} on "
                  f"{self.hosts.describe(name)} with the current weights, fingerprint verified: {len(self.live)} of "
                  f"{len(self.handles)} engine(s) generate", flush=True)
            self.joined.add(w)
            back.append(w)
        return back

    def _wait_for_room(self) -> None:
        """Fewer than min_live engines: wait (ray.node_wait_s) for Ray to place the missing ones again."""
        t0 = time.monotonic()
        said = -NODE_WAIT_LINE_EVERY_S
        while len(self.live) < self.min_live:
            waited = time.monotonic() - t0
            missing = [w for w in range(len(self.handles)) if w not in self.live]
            if waited >= self.node_wait_s:
                raise ActorFailed(
                    ", ".join(f"rollout worker {w}" for w in missing), "waiting for a node with room", died=True,
                    detail=f"{len(self.live)} of {len(self.handles)} engine(s) live, fewer than rollout.min_workers="
                    f"{self.min_live}, and no node with room for {self.bundle or 'them'} joined within "
                    f"ray.node_wait_s={self.node_wait_s:.0f}s ({self.hosts.room_note()}); add a node, or lower "
                    "rollout.min_workers to go on with fewer engines")
            if waited - said >= NODE_WAIT_LINE_EVERY_S:
                said = waited
                print(f"waiting for a node with room for rollout worker(s) {', '.join(map(str, missing))} "
                      f"({self.bundle or 'their bundle'} each): {len(self.live)} of {len(self.handles)} engine(s) live, "
                      f"rollout.min_workers={self.min_live}; {waited:.0f}s so far, at most ray.node_wait_s="
                      f"{self.node_wait_s:.0f}s ({self.hosts.room_note()})", flush=True)
            if not self.rejoin():
                time.sleep(2.0)
