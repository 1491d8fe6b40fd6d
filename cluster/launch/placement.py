"""Placing and creating the actors of a run: one placement group, a bundle per learner rank, per
rollout engine, the reference and each reward model, chooses the nodes at once (`ray.strategy`); waiting
until each has built its model; tearing them down.

With `ray.placement=separate` the group only chooses: it is removed once placed, and each actor asks for its
own resources on its bundle's node (node affinity). A placement group that lost a node with no room left
makes Ray 2.60's GCS retry without pause (a core busy until a node with room joins, every other GCS call
slowed: ray-project/ray#65007); actors on their own are restarted by Ray where a node has room, without
that. `colocate` keeps the group: learner rank i and engine i share one bundle's GPU.

An elastic start (separate placement, rollout.min_workers below num_workers): with no room
for every engine, the group is tried with one engine fewer, down to min_workers; the engines left out ask
Ray for room on their own (`start_waiting_rollouts`) and join the fleet when a node with room does.
"""
from __future__ import annotations

import socket
import time
import uuid
from dataclasses import dataclass, field

from actors.rewards.model_actor import RewardModelActor
from actors.rollout import RolloutWorker
from cluster.launch.hosts import node_table
from cluster.launch.network import bundle_node, bundle_nodes
from cluster.launch.shared_storage import check_shared_storage
from cluster.launch.thread_budget import idle_collect_threads, lends_idle_cores, thread_budget
from cluster.launch.waits import HOST_DEATH_WAIT_S, wait_dead, wait_for
from learner.reference import ReferenceActor
from learner.worker import LearnerWorker

# An elastic start tries the placement with one engine fewer when this passed with no room for it
ELASTIC_TRY_S = 5.0


@dataclass
class Actors:
    """Handles to every actor of a run, with the names used in error messages."""

    rollouts: list = field(default_factory=list)
    learners: list = field(default_factory=list)
    reference: object | None = None
    reward_models: dict = field(default_factory=dict)  # model:PATH entry -> its RewardModelActor
    reward_model_paths: dict = field(default_factory=dict)  # model:PATH entry -> its model directory
    placement_group: object | None = None
    learner_port_key: str = ""  # where learner rank 0 posts its rendezvous port (learner_port_key)
    master_address: str = "127.0.0.1"  # where learner rank 0 listens (rendezvous, weight sender)
    master_hostname: str = ""
    learner_bundles: list = field(default_factory=list)  # the placement-group bundle of each learner rank
    learner_nodes: list = field(default_factory=list)  # the Ray node id each learner rank was placed on
    # An elastic start: the engines with no room at start (their handle None until start_waiting_rollouts)
    waiting_rollouts: list = field(default_factory=list)


def learner_port_key() -> str:
    """A fresh key under which a new set of learner ranks' rank 0 posts the rendezvous port it bound (the OS's
    pick, in its own process) for the others (learner/rank_setup.py rendezvous_store). The driver picks no port:
    one picked here and bound there seconds later could be taken in between ("Address already in use")."""
    return f"learner-rendezvous-{uuid.uuid4().hex}"


def resources(cpus: float, gpus: float) -> dict:
    """An actor's Ray resources as a bundle ({"CPU": 1.0}, with "GPU" only when it asks for GPUs)."""
    return {"CPU": cpus, **({"GPU": gpus} if gpus else {})}


def start_engine(cfg, index: int, scheduling_strategy=None):
    """Rollout worker `index`. Restarted by Ray when it dies; the driver re-syncs weights and re-sends its
    prompts. max_task_retries=0: the call in flight fails (RayActorError) so the driver knows."""
    import ray

    r = cfg.rollout
    return (ray.remote(RolloutWorker)
            .options(num_cpus=r.num_cpus, num_gpus=r.num_gpus, max_restarts=r.max_restarts, max_task_retries=0,
                     scheduling_strategy=scheduling_strategy)
            .remote(cfg.model.path, r, worker_index=index, max_lora_rank=cfg.learner.vllm_max_lora_rank(),
                    chat_template_kwargs=dict(cfg.data.chat_template_kwargs)))


def scheduling(pg, bundle: int, node_id: str, soft: bool):
    """Where an actor runs: its bundle of `pg` (colocate), else its node. `soft`: when that node is gone,
    Ray restarts the actor on any node with room (engines, the reference, reward models)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

    if pg is not None:
        return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)
    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=soft)


@dataclass
class BundlePlan:
    """The placement group's bundles (Ray resources each) and which bundle each actor gets, by actor kind.

    separate: a bundle per learner rank, per engine, the reference, each reward model, in that order;
    colocate: learner rank i and engine i share bundle i (their resources summed)."""

    bundles: list = field(default_factory=list)
    rollouts: list = field(default_factory=list)  # engine i -> its bundle
    learners: list = field(default_factory=list)  # learner rank i -> its bundle
    reference: int | None = None  # None: no reference actor
    reward_models: list = field(default_factory=list)  # the i-th model:PATH entry -> its bundle

    def add(self, bundle: dict) -> int:
        self.bundles.append(bundle)
        return len(self.bundles) - 1


def plan_bundles(cfg, engines: int, *, with_reference: bool, num_reward_models: int) -> BundlePlan:
    """The bundles of a placement group that holds `engines` engines (an elastic start tries fewer)."""
    r, lrn, ref = cfg.rollout, cfg.learner, cfg.reference
    colocate = cfg.ray.placement == "colocate"
    plan = BundlePlan()
    for i in range(lrn.num_ranks):
        if colocate and i < engines:
            plan.rollouts.append(plan.add(resources(lrn.num_cpus + r.num_cpus, lrn.num_gpus + r.num_gpus)))
            plan.learners.append(plan.rollouts[-1])
        else:
            plan.learners.append(plan.add(resources(lrn.num_cpus, lrn.num_gpus)))
    plan.rollouts += [plan.add(resources(r.num_cpus, r.num_gpus)) for _ in range(len(plan.rollouts), engines)]
    if with_reference:
        plan.reference = plan.add(resources(ref.num_cpus, ref.num_gpus))
    plan.reward_models = [plan.add(resources(cfg.reward.model_num_cpus, cfg.reward.model_num_gpus))
                          for _ in range(num_reward_models)]
    return plan


def place_bundles(cfg, *, with_reference: bool, num_reward_models: int):
    """The placement group, ready, its plan and how many engines it holds.

    An elastic start (separate placement, any schedule): with no room for every engine now, the run starts
    with as many as fit, at least rollout.min_workers; the others join when a node with room does."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    r = cfg.rollout
    colocate = cfg.ray.placement == "colocate"
    fewest = r.min_live_workers() if not colocate else r.num_workers
    for engines in range(r.num_workers, fewest - 1, -1):
        plan = plan_bundles(cfg, engines, with_reference=with_reference, num_reward_models=num_reward_models)
        pg = placement_group(plan.bundles, strategy=cfg.ray.strategy)
        last = engines == fewest
        try:
            ray.get(pg.ready(), timeout=cfg.trainer.actor_timeout_s if last else ELASTIC_TRY_S)
            return pg, plan, engines
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)
            if last:
                raise RuntimeError(
                    f"Ray could not place {len(plan.bundles)} bundles {plan.bundles} within "
                    f"{cfg.trainer.actor_timeout_s:.0f}s: the cluster has {ray.cluster_resources()}; lower the "
                    "num_cpus/num_gpus of rollout/learner/reference"
                    + (", or rollout.min_workers to start with fewer engines" if not colocate else "")
                ) from None
    raise AssertionError("unreachable: the last try returns or raises")


def start_reference(cfg, scheduling_strategy):
    """The reference actor. Scoring log-probs is a pure function of its inputs, so Ray restarts a dead one
    and runs the call it lost again (max_task_retries)."""
    import ray

    ref = cfg.reference
    return (ray.remote(ReferenceActor)
            .options(num_cpus=ref.num_cpus, num_gpus=ref.num_gpus, max_restarts=ref.max_restarts,
                     max_task_retries=ref.max_restarts, scheduling_strategy=scheduling_strategy)
            .remote(cfg.model.path, ref))


def start_reward_model(cfg, path: str, scheduling_strategy):
    """A `model:PATH` reward's actor. Like the reference: scoring is a pure function of its inputs, so Ray
    restarts a dead reward model and runs the call it lost again; the driver waits on it with a timeout."""
    import ray

    rw = cfg.reward
    return (ray.remote(RewardModelActor)
            .options(num_cpus=rw.model_num_cpus, num_gpus=rw.model_num_gpus, max_restarts=rw.model_max_restarts,
                     max_task_retries=rw.model_max_restarts, scheduling_strategy=scheduling_strategy)
            .remote(path, rw))


def create_actors(cfg, *, with_reference: bool, reward_models: dict[str, str] | None = None) -> Actors:
    """One placement group holds a bundle per learner rank, per rollout engine, the reference and
    each reward model (`reward_models`: reward.functions entry -> its model directory, absolute;
    RewardScorer.actor_paths).

    `ray.placement=separate`: a bundle each; `colocate`: learner rank i and engine i share one.
    `ray.strategy` (PACK | SPREAD) says how bundles land on nodes.
    """
    import ray
    from ray.util.placement_group import remove_placement_group

    reward_models = reward_models or {}
    pg, plan, engines = place_bundles(cfg, with_reference=with_reference, num_reward_models=len(reward_models))
    if cfg.ray.address:  # a joined cluster: every node that got a bundle must share the storage (before any load)
        try:
            check_shared_storage(ray, bundle_nodes(pg), [cfg.model.path, *reward_models.values()], cfg.trainer.run_dir,
                                 cfg.trainer.actor_timeout_s)
        except BaseException:
            remove_placement_group(pg)
            raise

    # Where learner rank 0 listens for the other ranks and (as the weight sender) for the engines:
    # loopback when the cluster is our own embedded one, else the IP Ray knows rank 0's node by.
    master, master_host = (bundle_node(pg, plan.learners[0])[:2] if cfg.ray.address
                           else ("127.0.0.1", socket.gethostname()))
    nodes = bundle_nodes(pg)
    if cfg.ray.placement != "colocate":  # the nodes are chosen: each actor asks for its own resources there (module docstring)
        remove_placement_group(pg)
        pg = None

    def at(i, restart_elsewhere: bool = True):
        return scheduling(pg, i, nodes[i], soft=restart_elsewhere)

    out = Actors(placement_group=pg, learner_port_key=learner_port_key(), master_address=master, master_hostname=master_host,
                 learner_nodes=[nodes[b] for b in plan.learners],
                 waiting_rollouts=list(range(engines, cfg.rollout.num_workers)))
    out.rollouts = [start_engine(cfg, i, at(plan.rollouts[i])) for i in range(engines)]
    out.learner_bundles = plan.learners
    # Hard: rank 0's node is the address every peer was told (learner ranks are never restarted by Ray).
    out.learners = start_learners(cfg, [at(b, restart_elsewhere=False) for b in plan.learners], master,
                                  out.learner_port_key, master_host)
    if with_reference:
        out.reference = start_reference(cfg, at(plan.reference))
    for (spec, path), bundle in zip(reward_models.items(), plan.reward_models):
        out.reward_models[spec] = start_reward_model(cfg, path, at(bundle))
        out.reward_model_paths[spec] = path
    out.rollouts += [None] * len(out.waiting_rollouts)  # started by start_waiting_rollouts once the others hold their room
    return out


def start_waiting_rollouts(actors: Actors, cfg) -> None:
    """The engines an elastic start had no room for: each asks Ray for its resources on any node and waits
    (pending) until a node with room joins; the pool then gives it the current weights and takes it into the
    fleet (RolloutPool.rejoin). Started only after every placed actor holds its own resources: started
    earlier, one could take the room meant for them."""
    r = cfg.rollout
    if not actors.waiting_rollouts:
        return
    for i in actors.waiting_rollouts:
        actors.rollouts[i] = start_engine(cfg, i)
    need = resources(r.num_cpus, r.num_gpus)
    started = r.num_workers - len(actors.waiting_rollouts)
    print(f"no room yet for rollout worker(s) {', '.join(map(str, actors.waiting_rollouts))} ({need} each): the run "
          f"starts with {started} of {r.num_workers} engine(s) (rollout.min_workers={r.min_live_workers()}); each joins "
          "the fleet, with the current weights, when a node with room does", flush=True)


def start_learners(cfg, where: list, master: str, port_key: str, master_host: str) -> list:
    """A LearnerWorker per rank, `where[rank]` its scheduling strategy; rank 0 listens on `master`, on a port it
    posts under `port_key` (learner_port_key)."""
    import ray

    lrn = cfg.learner
    # A rank that may be lent cores gets the offer during train_step: it needs a concurrency group.
    learner_cls = ray.remote(concurrency_groups={"lend": 1})(LearnerWorker) if lends_idle_cores(cfg) \
        else ray.remote(LearnerWorker)
    return [learner_cls
            .options(num_cpus=lrn.num_cpus, num_gpus=lrn.num_gpus, max_restarts=0, scheduling_strategy=where[rank])
            .remote(cfg.model.path, lrn, cfg.algo, rank=rank, world_size=lrn.num_ranks, master_addr=master,
                    master_port=0, port_key=port_key, total_steps=cfg.trainer.steps, seed=cfg.trainer.seed,
                    reference_on_learner=cfg.reference_on_learner(), master_host=master_host,
                    connect_timeout_s=cfg.ray.connect_timeout_s)
            for rank in range(lrn.num_ranks)]


def restart_learners(actors: Actors, cfg, hosts) -> None:
    """New learner ranks, the engines and the other actors kept: each on its node, or, where that node was
    lost, on a live node with room for it (colocate: Ray moves the lost bundles of the placement group). Until
    every rank has a node (rank 0's address is where the ranks and the engines meet) this waits, at most
    ray.node_wait_s, saying what for."""
    import ray

    for h in actors.learners:
        try:
            ray.kill(h, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
    if actors.placement_group is None:  # their resources are free again once they are dead (counted below)
        for rank, h in enumerate(actors.learners):
            wait_dead(h, f"learner rank {rank}", HOST_DEATH_WAIT_S)
    lrn, pg = cfg.learner, actors.placement_group
    if pg is not None:  # colocate: the room a lost rank waits for is its whole bundle (its engine's share too)
        for rank, b in enumerate(actors.learner_bundles):
            wait_bundle_placed(pg, b, f"learner rank {rank}", pg.bundle_specs[b], cfg.ray.node_wait_s, hosts)
        actors.learner_nodes = [bundle_node(pg, b)[2] for b in actors.learner_bundles]
    else:
        actors.learner_nodes = nodes_with_room(actors.learner_nodes, resources(lrn.num_cpus, lrn.num_gpus),
                                               cfg.ray.node_wait_s, hosts)
    if cfg.ray.address:  # rank 0 may now be on another node: the ranks and the engines meet there
        table = node_table()
        actors.master_address = table[actors.learner_nodes[0]]["address"]
        actors.master_hostname = table[actors.learner_nodes[0]]["hostname"]
    actors.learner_port_key = learner_port_key()  # a fresh key: the old rank 0's post is stale
    where = [scheduling(pg, b, node, soft=False) for b, node in zip(actors.learner_bundles, actors.learner_nodes)]
    actors.learners = start_learners(cfg, where, actors.master_address, actors.learner_port_key, actors.master_hostname)


def nodes_with_room(nodes: list[str], need: dict, wait_s: float, hosts) -> list[str]:
    """`nodes` (one per learner rank, whose processes are gone) with each dead one replaced by a live node
    with room for `need` (its free resources, less what the ranks going back to it and earlier replacements
    take), waiting up to `wait_s` for one to join, saying so."""
    from ray._private.state import available_resources_per_node

    def find():
        table = node_table()
        free = {n: dict(r) for n, r in available_resources_per_node().items() if table.get(n, {}).get("alive")}
        for node in nodes:  # a rank whose node lives goes back there: what it takes is not room for another
            if table.get(node, {}).get("alive") and node in free:
                for k, v in need.items():
                    free[node][k] = free[node].get(k, 0.0) - v
        out, missing = [], []
        for rank, node in enumerate(nodes):
            if table.get(node, {}).get("alive"):
                out.append(node)
                continue
            room = next((n for n, r in free.items() if all(r.get(k, 0.0) >= v for k, v in need.items())), None)
            if room is None:
                missing.append(rank)
                continue
            for k, v in need.items():
                free[room][k] -= v
            out.append(room)
        return out, ", ".join(f"learner rank {r}" for r in missing) or None

    return wait_for_room(find, need, wait_s, hosts)


def wait_bundle_placed(pg, bundle: int, actor: str, resources: dict, wait_s: float, hosts) -> str:
    """The IP of the live node that holds `bundle` of `pg`, waiting up to `wait_s` for Ray to place it."""
    def find():
        ip = bundle_node(pg, bundle, live_only=True)[0]
        return ip, (None if ip else actor)

    return wait_for_room(find, resources, wait_s, hosts)


def wait_for_room(find, need: dict, wait_s: float, hosts):
    """`find()` -> (result, None) once the actors have a node, else (_, the actors still without one): polled
    after their host was lost, at most `wait_s`, saying what it waits for every 30 s, then failing naming them."""
    t0, said = time.monotonic(), -30.0
    while True:
        result, missing = find()
        if missing is None:
            return result
        waited = time.monotonic() - t0
        if waited >= wait_s:
            raise RuntimeError(f"no node with room for {missing} ({need}) joined within ray.node_wait_s={wait_s:.0f}s "
                               f"after its host was lost ({hosts.room_note(fresh=True)}); add a node with that room, or "
                               "restart the run on what is left with fewer or smaller learner ranks (it resumes from its "
                               "last checkpoint)")
        if waited - said >= 30.0:
            said = waited
            print(f"waiting for a node with room for {missing} ({need}): {waited:.0f}s so far, at most "
                  f"ray.node_wait_s={wait_s:.0f}s ({hosts.room_note(fresh=True)})", flush=True)
        time.sleep(2.0)


def wait_ready(actors: Actors, timeout_s: float) -> list[dict]:
    """Wait until every actor has built its model; returns their info (node, pid) for logs and tests."""
    # Said before the first wait: Ray's own start-up lines go to RUN_DIR/logs, and the first waiting line
    # comes WAITING_LINE_EVERY_S into the wait, so the console would otherwise be quiet from ray.init on.
    roles = [f"{sum(h is not None for h in actors.rollouts)} rollout engine(s)", f"{len(actors.learners)} learner rank(s)"] + \
        (["the reference actor"] if actors.reference is not None else []) + \
        ([f"{len(actors.reward_models)} reward model(s)"] if actors.reward_models else [])
    print(f"starting {', '.join(roles)}; each says what it waits on while it loads", flush=True)
    waits = [(h, f"rollout worker {i}", "starting its vLLM engine", {"role": f"rollout-{i}"})
             for i, h in enumerate(actors.rollouts) if h is not None]
    waits += [(h, f"learner rank {i}", "starting DeepSpeed", {"role": f"learner-{i}"}) for i, h in enumerate(actors.learners)]
    if actors.reference is not None:
        waits.append((actors.reference, "reference actor", "loading the model", {"role": "reference"}))
    waits += [(h, f"reward model {spec}", "loading the reward model", {"role": f"reward-{i}", "model": actors.reward_model_paths[spec]})
              for i, (spec, h) in enumerate(actors.reward_models.items())]
    infos, t0 = [], time.monotonic()
    for handle, name, what, info in waits:  # one after another: each ready one is said, so no wait is silent long
        infos.append({**info, **wait_for(handle.info.remote(), name, what, timeout_s)})
        print(f"{name} ready ({time.monotonic() - t0:.0f}s)", flush=True)
    return infos



def apply_thread_budget(actors: Actors, placement: list[dict], cfg) -> dict[str, int]:
    """Give every actor its torch thread count (cluster/launch/thread_budget.py: all of a node's cores
    to each phase of the sync schedule, split between generation and learning in the async one;
    rollout.threads, learner.threads, reference.threads override). Recorded in `placement`
    (placement.json)."""
    budget = thread_budget(cfg.trainer.mode, placement, {"rollout": cfg.rollout.threads,
                                                        "learner": cfg.learner.threads,
                                                        "reference": cfg.reference.threads})
    handles = actor_roles(actors)
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




def actor_roles(actors: Actors) -> dict:
    """Every actor by its placement.json role."""
    return {**{f"rollout-{i}": h for i, h in enumerate(actors.rollouts) if h is not None},
            **{f"learner-{i}": h for i, h in enumerate(actors.learners)},
            **({"reference": actors.reference} if actors.reference is not None else {}),
            **{f"reward-{i}": h for i, h in enumerate(actors.reward_models.values())}}


def shutdown_actors(actors: Actors) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    for h in [*actors.rollouts, *actors.learners, actors.reference, *actors.reward_models.values()]:
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
