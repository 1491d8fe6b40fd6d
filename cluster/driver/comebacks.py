"""What the driver does when an actor runs again in a new process.

Ray restarts an engine, the reference actor or a reward model whose process or host died (their
`max_restarts`), and an elastic fleet's engine starts late or rejoins once a node with room joins. The
new process has none of what the driver gave the old one. Whoever notices hands it over here:
- the rollout pool (cluster/driver/rollout_pool.py): an engine restarted (`engine_restarted`) or up
  again after its host was lost, or started late (`engine_up`): the current weights first, verified;
- the reference actor's RestartWatch (cluster/driver/actor_restarts.py): `actor_back`;
- the reward scorer, which says which reward models answered from a new process: `reward_models_back`,
  asked once per step.
Each gets its threads again, its new process and node go into placement.json, and the console says where
it runs now. (Learner ranks hold training state: they restart from a checkpoint, Trainer._restart_learners.)
"""
from __future__ import annotations

from actors.rewards.scorer import RewardScorer
from cluster.driver.engine_weights import EngineWeights
from cluster.driver.placement_record import PlacementRecord, actor_name
from cluster.driver.rollout_pool import RolloutPool
from cluster.launch.hosts import HostWatch
from cluster.launch.placement import Actors, actor_roles
from cluster.launch.waits import wait_for


class Comebacks:
    def __init__(self, actors: Actors, placement: PlacementRecord, hosts: HostWatch, threads: dict[str, int],
                 weights: EngineWeights, scorer: RewardScorer, pool: RolloutPool, timeout_s: float):
        """`threads`: each role's thread count (apply_thread_budget); `pool`: the engines, whose `on_restart` and
        `on_rejoin` are this object's handlers (cluster/driver/startup.py); `timeout_s`: trainer.actor_timeout_s."""
        self.actors, self.placement, self.hosts, self.threads = actors, placement, hosts, threads
        self.weights, self.scorer, self.pool, self.timeout_s = weights, scorer, pool, timeout_s

    def engine_restarted(self, worker_index: int, new_process: bool = True) -> None:
        """The pool's `on_restart`: the current weights to the engine (EngineWeights.restarted); a new process
        (Ray restarted it, on its node or another) recorded in placement.json with where it runs now."""
        self.weights.restarted(worker_index, new_process)
        if new_process:
            role = f"rollout-{worker_index}"
            row = self.placement.row(role)
            row.update(pid=self.pool.pids[worker_index],
                       node_id=self.hosts.where.get(f"rollout worker {worker_index}", row.get("node_id")))
            self.placement.say_network([role])

    def engine_up(self, worker_index: int, info: dict) -> None:
        """The pool's `on_rejoin`: an engine that left with its host is back, or one an elastic start had no
        room for has started; its process and node in placement.json, then the current weights (verified)."""
        role = f"rollout-{worker_index}"
        row = self.placement.row(role)
        row.update({k: info[k] for k in ("pid", "node_id", "hostname") if k in info})
        self.weights.rejoined(worker_index)
        row["threads"] = self.threads[role]
        self.placement.say_network([role])

    def actor_back(self, name: str, info: dict) -> None:
        """A restarted actor (the reference, after a lost host or in place, RestartWatch's `on_back`; a reward
        model, below): its threads again, its new process and node in placement.json."""
        row = self.placement.named(name)
        handle = actor_roles(self.actors)[row["role"]]
        wait_for(handle.set_threads.remote(row["threads"]), name, "setting its threads", self.timeout_s)
        row.update({k: info[k] for k in ("pid", "node_id") if k in info})
        self.placement.say_network([row["role"]])

    def reward_models_back(self) -> None:
        """Reward models Ray restarted during the step (their process died, or their host): like the reference
        actor, each gets its threads again and its new process and node in placement.json, and the console
        says where it runs now."""
        for spec in self.scorer.restarted_actors():
            name = actor_name(next(p for p in self.placement if p.get("model") == self.actors.reward_model_paths[spec]))
            info = wait_for(self.actors.reward_models[spec].info.remote(), name, "answering after its restart",
                            self.timeout_s)
            self.hosts.place(name, info.get("node_id"))
            self.actor_back(name, info)
            print(f"{name} runs again on {self.hosts.describe(name)}, with its threads", flush=True)
