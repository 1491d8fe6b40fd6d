"""On `local`: the engines, the learner ranks and the reference actor share this machine's cores.

A run gives each actor its torch threads from the thread budget (cluster/launch/thread_budget.py): in
the sync schedule each phase takes every core (the engines of one phase split them); in async and
pipeline the collecting side (engines, reference) and the learner side run at once and split the cores
between them, and in async the learner takes the collecting side's cores once its batch is collected.
A phase measured at the calibration's t0 threads takes, at t threads, A(t) / A(t0) of its time
(profile.py MeasuredSpeeds.thread_factor, A(t) = (1 - f) + f / t). Two sides that overlap:

    pipeline   step = max(E, L)                          E: collecting side at its share of the cores
    async      step = E                  if L <= E       L: learner side at its share
               step = E + (1 - E / L) L_all  otherwise   L_all: the learner at every core (the rest of its
                                                         work once collection ends and its cores are lent)

While both sides compute, each is slower than alone by more than its thread count says (the caches and the
memory bus are shared, and a core's time is split when the busy threads outnumber the cores): the
calibration measures a learner rank's step beside one generating engine, and the engine's calls beside the
rank, both at t threads (profile.py contention). More busy threads than that pair's take a fair share on top:

    side's time x= measured x max(1, busy threads / cores) / max(1, 2t / cores)
"""
from __future__ import annotations

from cluster.launch.thread_budget import thread_budget


def local_threads(engines: int, ranks: int, reference_actor: bool, mode: str, cores: int,
                  pinned: tuple[int, int, int] = (0, 0, 0)) -> dict[str, int]:
    """Threads per role ("rollout", "learner", "reference") on one node of `cores`, as a run's budget gives them;
    `pinned`: rollout.threads, learner.threads, reference.threads (> 0 wins over the budget, as in a run)."""
    placement = [{"role": f"rollout-{i}", "node_id": "local", "cores": cores} for i in range(engines)]
    placement += [{"role": f"learner-{i}", "node_id": "local", "cores": cores} for i in range(ranks)]
    if reference_actor:
        placement.append({"role": "reference", "node_id": "local", "cores": cores})
    budget = thread_budget(mode, placement, dict(zip(("rollout", "learner", "reference"), pinned)))
    return {"rollout": budget["rollout-0"], "learner": budget["learner-0"],
            "reference": budget.get("reference", budget["learner-0"])}


def overlapped(mode: str, engine_side: float, learner_side: float, learner_all_cores: float) -> float:
    """Seconds the two overlapping sides take together (module docstring)."""
    if mode == "pipeline" or learner_side <= engine_side or learner_side <= 0:
        return max(engine_side, learner_side)
    return engine_side + (1 - engine_side / learner_side) * learner_all_cores


def contention_factor(measured: float, busy_threads: int, cores: int, measured_threads: int) -> float:
    """A side's time beside the other over its time alone (module docstring): `measured` at one engine and one
    rank of `measured_threads` each, and the fair share of `busy_threads` on `cores` beyond that pair's."""
    return measured * max(1.0, busy_threads / cores) / max(1.0, 2 * measured_threads / cores)
