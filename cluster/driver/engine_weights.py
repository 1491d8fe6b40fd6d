"""The weights on the rollout engines, as the driver keeps them.

`EngineWeights` is the one place that connects the learner's transfer group to the live engines and
sends them the current weights, verified, whatever called for it: a step's update, an engine Ray
restarted (or whose call was lost with its connection), one that rejoined when a node with room came,
a resume, new learner ranks after a restart.

An engine that fails on the way is not the learner's fault: the pool (cluster/driver/rollout_pool.py)
revives it or takes it out of the fleet, and the update goes again. Only a learner rank's death and a
fingerprint mismatch reach the trainer.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from actors.transport.fingerprint import SyncMismatch
from cluster.launch.hosts import HostWatch
from cluster.launch.waits import ActorFailed, actor_error, wait_for

# A weight update (or the transfer's init) that an engine failed goes again; tried at most this many times.
# A partition Ray ends by marking the host dead took 3 here: the transfer cut, the next init's call to the
# engine unanswered (reach_actors' bound) while the pool waited for Ray's verdict, then the update without it.
ENGINE_UPDATE_TRIES = 4

if TYPE_CHECKING:
    from cluster.driver.rollout_pool import RolloutPool
    from cluster.driver.worker_groups import LearnerGroup


@dataclass
class WeightVersions:
    """The run's weight versions, one object that whoever reads them holds (the collector, the pipeline's
    feeder, the engines' updates), moved only by the training loop (a step's update, a resume) and by
    EngineWeights.update."""

    learner: int = 0  # the version of the learner's weights: the number of updates trained so far
    sent: int = 0  # the version every engine is known to hold (set after each verified update)


class EngineWeights:
    """What the engines hold and how they get the learner's weights (module docstring)."""

    def __init__(self, cfg, versions: WeightVersions, backend: str, pool: RolloutPool, learners: LearnerGroup,
                 threads: dict, hosts: HostWatch, lock: threading.RLock):
        """`versions`: the learner's weight version (what an update sends) and the engines' (set here);
        `backend`: the transfer backend (actors/transport/registry.py); `pool`: the engines (its handles, its
        live fleet; it calls back into `restarted` and `rejoined`); `learners`: the learner group, which sends;
        `threads`: each actor's thread count by role (a new engine process gets its own); `lock`: held around
        each update and, by the collector, each generate (vLLM must not serve one between the calls of an
        update)."""
        self.cfg, self.versions, self.backend, self.pool, self.learners = cfg, versions, backend, pool, learners
        self.threads, self.hosts, self.lock = threads, hosts, lock

    def update(self, send: bool = True, rebuild: bool = False) -> dict:
        """Send weights `versions.learner` to the live engines, verified (`send=False`: only connect); `rebuild`: the
        transfer group is built anew first, as it is after an engine left or an attempt failed.

        An engine that fails on the way (it died, left with its host, or Ray found the learner's connection
        to it cut) is revived or taken out of the fleet by the pool, and the whole update goes again, at
        most ENGINE_UPDATE_TRIES times. A revived engine is sent the weights from inside the pool too
        (`restarted`); the update again costs one more transfer, on a rare path. Raised: a fingerprint
        mismatch, and a failure no engine explains (a learner rank's death: Trainer.run restarts them)."""
        from ray.exceptions import RayActorError, RayTaskError

        r = self.cfg.rollout
        with self.lock:
            for attempt in range(1, ENGINE_UPDATE_TRIES + 1):
                try:
                    if rebuild or self.pool.fleet_changed:
                        self.learners.init_weight_sync(self.pool.live_handles, self.backend, r.bucket_mb,
                                                       r.tensor_parallel_size)
                        self.pool.fleet_changed = False
                    if not send:
                        return {}
                    version = self.versions.learner
                    out = self.learners.sync_weights(version, watch=self.host_lost)
                    self.versions.sent = version
                    return out
                except SyncMismatch:
                    raise
                except Exception as e:
                    # The learner's own call to an engine failed (Ray types its error as the cause's): an engine
                    # that lives but whose connection was cut answers the next call. A learner rank's death
                    # (ActorFailed) is not that; it goes again only if the pool found an engine changed.
                    # An engine that hung mid-transfer (SIGSTOP, a stalled node) makes the learner's call time out
                    # (gloo's own bound); one that answers again by the check below leaves nothing changed, and
                    # the update goes again all the same, the transfer group rebuilt (issue 59, seen end to end).
                    cut = isinstance(e, RayActorError) or (isinstance(e, ActorFailed) and not e.died)
                    if attempt == ENGINE_UPDATE_TRIES or not (self.pool.recover_all() or cut):
                        raise
                    what = f"sending weights version {self.versions.learner}" if send else "connecting"
                    why = actor_error(e.cause if isinstance(e, RayTaskError) else e)
                    print(f"{what} to the rollout engines failed ({why}); the engines were checked (a dead one revived, "
                          f"a lost one out of the fleet) and it goes again ({attempt + 1}/{ENGINE_UPDATE_TRIES})", flush=True)
                    rebuild = True
            raise AssertionError("unreachable")

    def host_lost(self) -> str | None:
        """While the weights travel: an engine whose host was lost (a partition: no connection reset reaches
        the sender) would hold the transfer until its timeout; named, the transfer is given up on (PeerLost),
        the engine leaves the fleet and the update goes to the others (`update`)."""
        lost = [f"rollout worker {w}" for w in self.pool.lost_with_host()]
        return (f"{', '.join(lost)} was lost with its host during the transfer, which would wait for it until its "
                f"timeout (trainer.actor_timeout_s={self.cfg.trainer.actor_timeout_s:.0f}s)") if lost else None

    def restarted(self, worker_index: int, new_process: bool = True) -> None:
        """The pool's `on_restart`: a restarted engine holds the base weights (one whose call was lost with its
        connection may have missed an update): the transfer group rebuilt and the current weights sent.

        Runs with the lock held. If the learner is mid-step, Ray queues these calls after it, so the engine
        may get weights one step newer than `versions.learner` says; the loss still uses the behaviour log-probs of
        what actually sampled (TIS), so this stays correct."""
        # the pids named: a line that says "the same process" can be checked (issue 59 saw one for a killed engine)
        was, now = self.pool.pid_before[worker_index], self.pool.pids[worker_index]
        print(f"rollout worker {worker_index} " + (f"restarted as a new process (pid {was} -> {now})" if new_process else
              f"answers again as the process the driver last knew (pid {now}; a call of it was lost, or it missed an "
              "update)") + f"; re-syncing weights version {self.versions.learner}", flush=True)
        self.resync(worker_index)

    def rejoined(self, worker_index: int) -> None:
        """An engine that left with its host is back (Ray placed it on a node with room), or one an elastic
        start had no room for has started: its threads, the transfer group rebuilt with it, the current
        weights sent; the sync checks every engine's fingerprint (a mismatch raises) before the engine is
        given prompts."""
        print(f"rollout worker {worker_index} is up; sending it weights version {self.versions.learner}", flush=True)
        self.resync(worker_index)

    def resync(self, worker_index: int | None = None) -> None:
        """The transfer group rebuilt with the live engines and the current weights sent to them (verified);
        `worker_index`: a new engine process, which gets its thread count first."""
        with self.lock:
            if worker_index is not None:
                # An engine an elastic start had no room for has no share of the thread plan: its bundle's CPUs
                threads = self.threads.setdefault(f"rollout-{worker_index}",
                                                  self.cfg.rollout.threads or max(1, round(self.cfg.rollout.num_cpus)))
                wait_for(self.pool.handles[worker_index].set_threads.remote(threads),
                         f"rollout worker {worker_index}", "setting its threads", self.cfg.trainer.actor_timeout_s)
            self.update(rebuild=True)
