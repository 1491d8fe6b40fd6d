"""Ray resources: start or join a cluster, place the actors, create them, and wait on them safely.

Every wait on an actor goes through `wait_for` (or `wait_all` for a group, such as the learner
ranks, which fails on the first actor that fails), which has a timeout and, when it runs out or
the actor dies, raises an error that names the actor and what it was doing. Nothing here
blocks forever.
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field

# Set in every Ray worker process. No hub access anywhere; keep tokenizers single-threaded so
# several actors share a small machine without oversubscribing its cores.
WORKER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def worker_runtime_env(extra_env: dict[str, str] | None = None) -> dict:
    env = {k: os.environ.get(k, v) for k, v in WORKER_ENV.items()}
    env.update(extra_env or {})
    return {"env_vars": env}


class ActorFailed(RuntimeError):
    """An actor died or did not answer in time; `.actor` names it, `.died` tells which."""

    def __init__(self, actor: str, what: str, died: bool, detail: str = ""):
        self.actor, self.what, self.died = actor, what, died
        reason = "died" if died else "did not answer in time"
        super().__init__(f"{actor} {reason} while {what}" + (f": {detail}" if detail else ""))


# After one actor of a group fails with an error, how long the others may take to show that one of
# them died: a rank whose collective lost its peer raises too, and the dead peer is the cause.
PEER_DEATH_GRACE_S = 10.0


def wait_for(refs, actor: str, what: str, timeout_s: float):
    """ray.get with a timeout; a dead or silent actor becomes ActorFailed naming it."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    try:
        return ray.get(refs, timeout=timeout_s)
    except GetTimeoutError:
        raise _no_answer(actor, what, timeout_s) from None
    except RayActorError as e:
        raise ActorFailed(actor, what, died=True, detail=str(e).splitlines()[0]) from e


def _no_answer(actor: str, what: str, timeout_s: float) -> ActorFailed:
    return ActorFailed(actor, what, died=False, detail=f"no answer within {timeout_s:.0f}s "
                       "(raise trainer.actor_timeout_s if this machine is just slow)")


def wait_all(refs: list, actors: list[str], what: str, timeout_s: float) -> list:
    """The results of one call per actor (`actors` names them), failing on the first actor that
    dies or raises, not in list order: ranks that sit in a collective with a dead peer would
    otherwise hold the wait until the timeout, and their timeout would hide the death."""
    import ray
    from ray.exceptions import RayActorError

    deadline, pending, results = time.monotonic() + timeout_s, list(refs), {}
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise _no_answer(actors[refs.index(pending[0])], what, timeout_s)
        try:
            results[refs.index(ready[0])] = ray.get(ready[0])
        except RayActorError as e:
            raise ActorFailed(actors[refs.index(ready[0])], what, died=True, detail=str(e).splitlines()[0]) from e
        except Exception:
            # An error of its own, or its collective lost a peer: if a peer died, that is the cause.
            done, _ = ray.wait(pending, num_returns=len(pending), timeout=PEER_DEATH_GRACE_S) if pending else ([], [])
            for ref in done:
                try:
                    ray.get(ref)
                except RayActorError as e:
                    raise ActorFailed(actors[refs.index(ref)], what, died=True, detail=str(e).splitlines()[0]) from e
                except Exception:  # noqa: BLE001 (another rank's own error: the first one is reported)
                    pass
            raise
    return [results[i] for i in range(len(refs))]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_ray(address: str, num_cpus: int) -> None:
    """Join `address` ("auto" or HOST:PORT), or start an embedded local cluster sized to the machine."""
    import ray

    if ray.is_initialized():
        return
    if address:
        join_cluster(address)
        return
    # Logical CPUs: at least 8 so that fractional actors fit on a 2-core machine; they mostly
    # wait on each other, and each limits its own threads.
    cpus = num_cpus or max(8, os.cpu_count() or 1)
    ray.init(num_cpus=cpus, include_dashboard=False, runtime_env=worker_runtime_env(), log_to_driver=True)


def join_cluster(address: str) -> None:
    """Connect this driver to a running cluster ("auto" or HOST:PORT of its GCS) in the cluster's
    authentication mode (token discovery as `submit`: cluster/launch/auth.py)."""
    import ray

    from cluster.launch.auth import explain_auth_failure, gcs_auth_mode, resolve_gcs_address, use_cluster_auth_mode

    gcs = resolve_gcs_address(address)
    use_cluster_auth_mode(gcs_auth_mode(gcs), gcs)
    try:
        ray.init(address=gcs, runtime_env=worker_runtime_env(), log_to_driver=True)
    except Exception as e:
        raise (explain_auth_failure(e, gcs) or e) from e


@dataclass
class Actors:
    """Handles to every actor of a run, with the names used in error messages."""

    rollouts: list = field(default_factory=list)
    learners: list = field(default_factory=list)
    reference: object | None = None
    placement_group: object | None = None
    learner_port: int = 0


def create_actors(cfg, *, with_reference: bool) -> Actors:
    """One placement group holds a bundle per learner rank, per rollout engine and the reference.

    `ray.placement=separate`: a bundle each; `colocate`: learner rank i and engine i share one.
    `ray.strategy` (PACK | SPREAD) says how bundles land on nodes.
    """
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from actors.reference import ReferenceActor
    from actors.rollout import RolloutWorker
    from learner.worker import LearnerWorker

    r, lrn, ref = cfg.rollout, cfg.learner, cfg.reference

    def res(cpus, gpus):
        return {"CPU": cpus, **({"GPU": gpus} if gpus else {})}

    bundles, rollout_bundle, learner_bundle = [], [], []
    colocate = cfg.ray.placement == "colocate"
    for i in range(lrn.num_ranks):
        if colocate and i < r.num_workers:
            bundles.append(res(lrn.num_cpus + r.num_cpus, lrn.num_gpus + r.num_gpus))
            rollout_bundle.append(len(bundles) - 1)
        else:
            bundles.append(res(lrn.num_cpus, lrn.num_gpus))
        learner_bundle.append(len(bundles) - 1)
    for _ in range(len(rollout_bundle), r.num_workers):
        bundles.append(res(r.num_cpus, r.num_gpus))
        rollout_bundle.append(len(bundles) - 1)
    if with_reference:
        bundles.append(res(ref.num_cpus, ref.num_gpus))
    pg = placement_group(bundles, strategy=cfg.ray.strategy)
    try:
        ray.get(pg.ready(), timeout=cfg.trainer.actor_timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(
            f"Ray could not place {len(bundles)} bundles {bundles} within {cfg.trainer.actor_timeout_s:.0f}s: "
            f"the cluster has {ray.cluster_resources()}; lower the num_cpus/num_gpus of rollout/learner/reference"
        ) from None

    def at(i):
        return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)

    out = Actors(placement_group=pg, learner_port=free_port())
    # Where learner rank 0 listens for the other ranks and (as the weight sender) for the engines:
    # loopback when the cluster is our own embedded one, else the IP Ray knows rank 0's node by.
    master = bundle_node_ip(pg, learner_bundle[0]) if cfg.ray.address else "127.0.0.1"
    for i in range(r.num_workers):
        # Restarted by Ray when they die; the driver re-syncs weights and re-sends their prompts.
        # max_task_retries=0: the call in flight fails (RayActorError) so the driver knows.
        out.rollouts.append(
            ray.remote(RolloutWorker)
            .options(num_cpus=r.num_cpus, num_gpus=r.num_gpus, max_restarts=r.max_restarts, max_task_retries=0,
                     scheduling_strategy=at(rollout_bundle[i]))
            .remote(cfg.model.path, r, worker_index=i, max_lora_rank=lrn.vllm_max_lora_rank(),
                    chat_template_kwargs=dict(cfg.data.chat_template_kwargs))
        )
    # A rank that may be lent cores gets the offer during train_step: it needs a concurrency group.
    learner_cls = ray.remote(concurrency_groups={"lend": 1})(LearnerWorker) if lends_idle_cores(cfg) \
        else ray.remote(LearnerWorker)
    for rank in range(lrn.num_ranks):
        out.learners.append(
            learner_cls
            .options(num_cpus=lrn.num_cpus, num_gpus=lrn.num_gpus, max_restarts=0,
                     scheduling_strategy=at(learner_bundle[rank]))
            .remote(cfg.model.path, lrn, cfg.algo, rank=rank, world_size=lrn.num_ranks, master_addr=master,
                    master_port=out.learner_port, total_steps=cfg.trainer.steps, seed=cfg.trainer.seed,
                    reference_on_learner=cfg.reference_on_learner())
        )
    if with_reference:
        out.reference = (
            ray.remote(ReferenceActor)
            .options(num_cpus=ref.num_cpus, num_gpus=ref.num_gpus, max_restarts=ref.max_restarts,
                     max_task_retries=ref.max_restarts, scheduling_strategy=at(len(bundles) - 1))
            .remote(cfg.model.path, ref)
        )
    return out


def bundle_node_ip(pg, bundle: int) -> str:
    """The IP (as Ray knows the node) of the node a ready placement group put `bundle` on."""
    import ray
    from ray.util.placement_group import placement_group_table

    node_id = placement_group_table(pg)["bundles_to_node_id"][bundle]
    return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)


def wait_ready(actors: Actors, timeout_s: float) -> list[dict]:
    """Wait until every actor has built its model; returns their info (node, pid) for logs and tests."""
    infos = []
    for i, h in enumerate(actors.rollouts):
        infos.append({"role": f"rollout-{i}", **wait_for(h.info.remote(), f"rollout worker {i}", "starting its vLLM engine", timeout_s)})
    for i, h in enumerate(actors.learners):
        infos.append({"role": f"learner-{i}", **wait_for(h.info.remote(), f"learner rank {i}", "starting DeepSpeed", timeout_s)})
    if actors.reference is not None:
        infos.append({"role": "reference", **wait_for(actors.reference.info.remote(), "reference actor", "loading the model", timeout_s)})
    return infos


def lends_idle_cores(cfg) -> bool:
    """Whether the learner ranks may be lent the collecting side's idle cores (actors/threads.py
    idle_collect_threads): async on CPU, without a learner.threads override. One rule for both
    the actors it needs (a concurrency group) and the offers made to them."""
    return cfg.trainer.mode == "async" and cfg.learner.num_gpus == 0 and not cfg.learner.threads


def apply_thread_budget(actors: Actors, placement: list[dict], cfg) -> dict[str, int]:
    """Give every actor its torch thread count (actors/threads.py: all of a node's cores to each phase
    of the sync schedule, split between generation and learning in the async one; rollout.threads,
    learner.threads, reference.threads override). Recorded in `placement` (placement.json)."""
    from actors.threads import idle_collect_threads, thread_budget

    budget = thread_budget(cfg.trainer.mode, placement, {"rollout": cfg.rollout.threads,
                                                        "learner": cfg.learner.threads,
                                                        "reference": cfg.reference.threads})
    handles = {**{f"rollout-{i}": h for i, h in enumerate(actors.rollouts)},
               **{f"learner-{i}": h for i, h in enumerate(actors.learners)},
               **({"reference": actors.reference} if actors.reference is not None else {})}
    refs = {role: h.set_threads.remote(budget[role]) for role, h in handles.items()}
    for role, ref in refs.items():
        wait_for(ref, role, "setting its threads", cfg.trainer.actor_timeout_s)
    idle = idle_collect_threads(cfg.trainer.mode, placement, {"learner": cfg.learner.threads}) \
        if lends_idle_cores(cfg) else {}
    for p in placement:
        p["threads"] = budget[p["role"]]
        if p["role"] in idle:
            p["threads_when_collecting_idles"] = idle[p["role"]]
    return budget


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


def shutdown_actors(actors: Actors) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    for h in [*actors.rollouts, *actors.learners, actors.reference]:
        if h is not None:
            try:
                ray.kill(h, no_restart=True)
            except Exception:  # already gone
                pass
    if actors.placement_group is not None:
        try:
            remove_placement_group(actors.placement_group)
        except Exception:
            pass
