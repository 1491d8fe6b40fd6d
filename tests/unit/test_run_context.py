"""The run's context (cluster/driver/context.py): start-up builds it once over the started actors, and every part
holds the same pool, learner group and versions from construction on; nothing is wired in afterwards. The
actors are faked (start_actors replaced): no Ray."""
from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

from cluster.config import RunConfig
from cluster.driver import startup
from cluster.driver.collector import Collector
from cluster.driver.engine_weights import WeightVersions
from cluster.driver.placement_record import PlacementRecord
from cluster.driver.startup import RunInputs, StartedActors, start_run
from cluster.driver.worker_groups import LearnerGroup
from cluster.launch.hosts import HostWatch
from cluster.launch.placement import Actors


def test_start_up_builds_the_context_once_and_every_part_holds_the_same_state(tmp_path, monkeypatch):
    cfg = RunConfig()
    cfg.rollout.num_workers = 2
    actors = Actors(rollouts=["engine-0", "engine-1"], learners=["rank-0"], reference="the reference")
    rows = [{"role": "rollout-0", "pid": 10}, {"role": "rollout-1", "pid": 11}, {"role": "learner-0", "pid": 12},
            {"role": "reference", "pid": 13}]
    placement = PlacementRecord(rows, tmp_path, actors, timeout_s=5.0)
    monkeypatch.setattr(startup, "start_actors", lambda *a: StartedActors(actors, placement, {"rollout-0": 1}, {0: 2},
                                                                         1000, HostWatch()))
    monkeypatch.setattr(startup, "start_waiting_rollouts", lambda actors, cfg: None)
    versions, lock = WeightVersions(learner=3), threading.RLock()
    inputs = RunInputs(SimpleNamespace(eos_token_id=7), [], stream="the stream", scorer="the scorer", env_notes="notes")
    ctx = start_run(cfg, Path(tmp_path), inputs, stop=None, versions=versions, engines_lock=lock)

    assert ctx.pool.handles is actors.rollouts and ctx.pool.pids == [10, 11]
    assert ctx.reference.handle == "the reference" and ctx.reference.restarts is ctx.restarts  # its calls waited on so
    assert ctx.weights.pool is ctx.pool and ctx.comebacks.pool is ctx.pool and ctx.weights.learners is ctx.learners
    assert ctx.versions is versions and ctx.weights.versions is versions and ctx.weights.lock is lock
    assert ctx.restarts.pids == {"reference actor": 13} and (ctx.lend, ctx.learner_params, ctx.eos_id) == ({0: 2}, 1000, 7)
    collector = Collector(ctx)
    assert collector.pool is ctx.pool and collector.learners is ctx.learners and collector.engines_lock is lock

    # the pool's handlers reach the comebacks built after it: an engine back goes to the weights, then placement.json
    restarted = []
    monkeypatch.setattr(ctx.comebacks, "engine_restarted", lambda w, new_process: restarted.append((w, new_process)))
    ctx.pool.on_restart(1, False)
    assert restarted == [(1, False)]


def test_new_learner_ranks_reach_every_holder_of_the_group():
    """After a learner restart the group's calls go to the new ranks (which count their train calls from 0), for
    the collector and the engines' weights alike: they hold the group, not its handles."""
    group = LearnerGroup(["old-rank-0"], timeout_s=5.0)
    group.train_calls = 4
    holder = SimpleNamespace(learners=group)
    group.use(["new-rank-0"])
    assert holder.learners.handles == ["new-rank-0"] and holder.learners.train_calls == 0
