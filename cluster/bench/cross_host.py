"""Part `crosshost`: the weight update across two hosts against a raw gloo broadcast of the same
bytes on the same link, in one run. Needs a joined cluster of at least two nodes (ray.address): the
learner rank (the sender) runs on the driver's node, the engine on another; the raw broadcast's two
ends run on the same two nodes, over the same kind of group (actors.runtime.sockets.new_gloo_group).

On one machine, tests/hosts.py makes the two hosts (`python tests/hosts.py -- raygrpo bench --parts
crosshost ...` runs it there); on a real cluster, run the bench from the head with ray.address=auto.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import time

from actors.rollout import RolloutWorker
from actors.runtime.sockets import free_port
from actors.transport.registry import resolve_backend
from cluster.bench.learner_sync import GlooPeer
from cluster.bench.report import progress, ratio
from cluster.driver.worker_groups import LearnerGroup
from learner.worker import LearnerWorker


def two_nodes(ray) -> tuple[dict, dict]:
    """(the driver's node, another alive node), or a clear error when the cluster has one node."""
    here = ray.get_runtime_context().get_node_id()
    alive = [n for n in ray.nodes() if n["Alive"]]
    mine = next(n for n in alive if n["NodeID"] == here)
    others = [n for n in alive if n["NodeID"] != here]
    if not others:
        raise RuntimeError("bench part crosshost needs a Ray cluster of two nodes or more (ray.address=HEAD:PORT "
                           "of one; on one machine: python tests/hosts.py -- raygrpo bench --parts crosshost ...); "
                           f"this cluster has one ({mine['NodeManagerAddress']})")
    return mine, others[0]


def on(node: dict):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node["NodeID"], soft=False)


def machine_of(ray, node: dict, timeout_s: float) -> dict:
    """The kernel a node runs on (its boot id) and the cores it sees: two "hosts" of one kernel (tests/hosts.py's
    namespaces) share their cores, so both ends of the broadcast and every step of an update compete for them."""
    def read() -> dict:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return {"boot_id": f.read().strip(), "cpus": len(os.sched_getaffinity(0))}

    return ray.get(ray.remote(num_cpus=0)(read).options(scheduling_strategy=on(node)).remote(), timeout=timeout_s)


def bench_cross_host(ray, model: str, cfg, repeats: int, timeout_s: float) -> dict:
    """Full updates learner (node A) -> engine (node B), then a raw broadcast A -> B of the same bytes."""
    a, b = two_nodes(ray)
    host_a, host_b = a.get("NodeManagerHostname", "?"), b.get("NodeManagerHostname", "?")
    ip_a = a["NodeManagerAddress"]
    backend = resolve_backend(cfg.rollout.weight_transfer_backend, cfg.rollout.num_gpus)
    if backend != "gloo":
        raise RuntimeError(f"bench part crosshost compares with a raw gloo broadcast: it needs the gloo backend, "
                           f"got {backend} (rollout.weight_transfer_backend=gloo)")
    progress(f"crosshost: learner rank on {host_a} ({ip_a}), engine on {host_b} ({b['NodeManagerAddress']}), "
             f"1 warm-up + {repeats} full updates, then the raw broadcast")
    kernels = [machine_of(ray, n, timeout_s) for n in (a, b)]
    one_machine = kernels[0]["boot_id"] == kernels[1]["boot_id"]
    if one_machine:
        progress(f"crosshost: {host_a} and {host_b} run on one kernel, sharing its {kernels[0]['cpus']} cores: the "
                 "update's own work (packing, copies, re-packing) competes with both ends of the broadcast")
    lcfg = dataclasses.replace(cfg.learner, num_ranks=1)
    learner = ray.remote(LearnerWorker).options(num_cpus=lcfg.num_cpus, max_restarts=0, scheduling_strategy=on(a)) \
        .remote(model, lcfg, cfg.algo, rank=0, world_size=1, master_addr=ip_a, master_port=free_port(),
                total_steps=1000, seed=0, master_host=host_a, connect_timeout_s=cfg.ray.connect_timeout_s)
    engine = ray.remote(RolloutWorker).options(num_cpus=cfg.rollout.num_cpus, scheduling_strategy=on(b)) \
        .remote(model, cfg.rollout)
    peers = []
    try:
        ray.get([learner.info.remote(), engine.info.remote()], timeout=timeout_s)
        group = LearnerGroup([learner], timeout_s)
        group.init_weight_sync([engine], backend, cfg.rollout.bucket_mb, 1)
        outs, walls = [], []
        for v in range(repeats + 1):
            t = time.perf_counter()
            outs.append(group.sync_weights(v + 1))
            walls.append(time.perf_counter() - t)
        outs, walls = outs[1:], walls[1:]
        sync = {"bytes": outs[0]["bytes"], "repeats": repeats, "transport": outs[0].get("transport"),
                "seconds": statistics.median(o["seconds"] for o in outs), "wall_seconds": statistics.median(walls),
                "seconds_each": [round(o["seconds"], 4) for o in outs],
                "verified": all(o.get("verified") for o in outs),
                "parts": {k: statistics.median(o["parts"][k] for o in outs) for k in outs[0].get("parts", {})}}
        ray.kill(engine)
        ray.kill(learner)
        # The same two nodes, the same link, the same bytes: one flat tensor.
        cls = ray.remote(num_cpus=0.5)(GlooPeer)
        peers = [cls.options(scheduling_strategy=on(a)).remote(0), cls.options(scheduling_strategy=on(b)).remote(1)]
        port = ray.get(peers[0].host_store.remote(), timeout=timeout_s)
        ray.get([p.join.remote(ip_a, port, 2) for p in peers], timeout=timeout_s)
        ta, tb = ray.get([p.broadcast.remote(sync["bytes"], repeats + 1) for p in peers], timeout=timeout_s)
        each = [max(x, y) for x, y in zip(ta[1:], tb[1:])]
        raw = {"bytes": sync["bytes"], "seconds": statistics.median(each), "seconds_each": [round(x, 5) for x in each]}
    finally:
        for h in (learner, engine, *peers):
            with contextlib.suppress(Exception):  # already gone
                ray.kill(h)
    return {"host_a": host_a, "host_b": host_b, "address_a": ip_a, "address_b": b["NodeManagerAddress"],
            "one_machine": one_machine, "cpus": [k["cpus"] for k in kernels],
            "sync": sync, "raw_broadcast": raw, "vs_raw": ratio(sync["seconds"], raw["seconds"])}


def table_rows(res: dict) -> list[tuple]:
    ch = res.get("cross_host")
    if not ch:
        return []
    link = f"{ch['host_a']} -> {ch['host_b']}"
    return [("crosshost", "full update seconds (median)", ch["sync"]["seconds"],
             f"{ch['sync']['bytes'] / 2**20:.2f} MiB, learner -> vLLM, {link}, {ch['sync']['transport']}"),
            ("crosshost", "raw gloo broadcast seconds", ch["raw_broadcast"]["seconds"], f"same bytes, {link}"),
            ("crosshost", "full update / raw broadcast", ch["vs_raw"], "goal <= 1.4" + (
                f"; both hosts on one kernel, {ch['cpus'][0]} cores shared" if ch.get("one_machine") else ""))]
