"""The CPU thread budget (the driver's plan; each actor applies its count with
actors/runtime/threads.py use_threads): every phase of a step uses the cores that are free while it runs.

A CPU actor computes with torch's OpenMP threads. Ray's `num_cpus` is a scheduling share, not
a thread count (0.5 CPU would be one thread that leaves the other core idle), so the driver
gives every actor a thread count from the schedule and the placement (`thread_budget`), and
each actor applies it at the start of every coarse call (`use_threads`):

  sync schedule   generate -> reference -> train -> sync run one after another, so each phase
                  takes all of its node's cores, shared only by the actors of the same role on
                  that node (two learner ranks on a 2-core node: one thread each).
  async schedule  generation overlaps the learner side (reference, then train), so a node that
                  holds both splits its cores between them in proportion to their actor counts.
  pipeline        the same split: the engines never stop while the learner trains (without it, each
                  of engine, rank and reference took both cores of a 2-core node: 2.7 threads a core).

In async, a batch is often collected before the learner's step ends: from then until the step
ends the collecting side's cores are idle, and the learner ranks on that node take them
(`idle_collect_threads`; the driver tells the ranks, they apply it at their next decoder layer
and give the cores back when the step returns).

An idle actor holds no core: OpenMP's worker threads spin for about a millisecond after a
parallel region, then sleep. `rollout.threads`, `learner.threads` and `reference.threads`
(> 0) override the budget per role; a reward-model actor ("reward-i") is budgeted as the reference is.
"""
from __future__ import annotations

from collections import Counter

ROLES = ("rollout", "learner", "reference", "reward")  # reward: a reward-model actor (model:PATH entries)


def thread_budget(mode: str, placement: list[dict], overrides: dict[str, int] | None = None) -> dict[str, int]:
    """Threads for every actor, by its placement role ("rollout-0", "learner-1", "reference").

    `placement`: one dict per actor with "role", "node_id" and "cores" (its node's `node_cores()`).
    `mode`: "sync", "async" or "pipeline" (trainer.mode). `overrides`: {"rollout": n, ...}, n > 0 wins.
    """
    overrides = overrides or {}
    per_node: dict = {}
    for p in placement:
        per_node.setdefault(p["node_id"], Counter())[role_of(p["role"])] += 1
    out = {}
    for p in placement:
        role, count, cores = role_of(p["role"]), per_node[p["node_id"]], max(1, int(p["cores"]))
        out[p["role"]] = overrides.get(role, 0) or _share(mode, role, count, cores)
    return out


def idle_collect_threads(mode: str, placement: list[dict], overrides: dict[str, int] | None = None) -> dict[str, int]:
    """Threads for each learner rank while its node's collecting side (engines, reference) is idle:
    its sync-schedule share. Only ranks that get more than their async share are listed; none in
    the sync schedule (every phase already has every core) or with a learner.threads override."""
    overrides = overrides or {}
    if mode != "async" or overrides.get("learner", 0):
        return {}
    base, idle = thread_budget(mode, placement, overrides), thread_budget("sync", placement, overrides)
    return {role: idle[role] for role in base if role_of(role) == "learner" and idle[role] > base[role]}


def role_of(placement_role: str) -> str:
    role = placement_role.split("-")[0]
    if role not in ROLES:
        raise ValueError(f"unknown actor role {placement_role!r}; expected one of {ROLES} (with -i)")
    return role


def _share(mode: str, role: str, count: Counter, cores: int) -> int:
    """One actor's threads on a node with `cores` cores holding `count` actors per role."""
    engines, ranks = count["rollout"], count["learner"]
    # In async and pipeline, collecting and training run at once. The reference and reward-model actors run right
    # after generation, on the collecting side (cluster/driver/collector.py Collector.collect), so they share its cores.
    collecting = engines or count["reference"] or count["reward"]
    if mode in ("async", "pipeline") and collecting and ranks:
        gen = min(cores - 1, max(1, round(cores * collecting / (collecting + ranks)))) if cores > 1 else 1
        cores = max(1, cores - gen) if role == "learner" else gen
    if role == "rollout":
        return max(1, cores // engines)
    if role == "learner":
        return max(1, cores // ranks)
    return cores


def lends_idle_cores(cfg) -> bool:
    """Whether the learner ranks may be lent the collecting side's idle cores (`idle_collect_threads`):
    async on CPU, without a learner.threads override. One rule for both the actors it needs (a
    concurrency group) and the offers made to them."""
    return cfg.trainer.mode == "async" and cfg.learner.num_gpus == 0 and not cfg.learner.threads
