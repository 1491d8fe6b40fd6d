"""2 + 4. Learner tokens/s (ZeRO-2/3) and weight sync vs a raw gloo broadcast."""
from __future__ import annotations

import dataclasses
import datetime
import random
import statistics
import time

import torch
import torch.distributed as dist

from actors.runtime.process_groups import new_gloo_group
from actors.transport.registry import resolve_backend
from cluster.bench.report import per_second, progress, ratio
from cluster.driver.worker_groups import LearnerGroup
from cluster.launch.placement import learner_port_key
from learner.batch import TrainBatch
from learner.worker import LearnerWorker


def fixed_batch(rollouts, pad_id: int, seed: int = 0, with_ref: bool = False):
    """A TrainBatch from real rollouts, with fixed pseudo-random advantages (the same every run)."""
    g = random.Random(seed)
    prompt_ids = [r.prompt_ids for r in rollouts for _ in r.completions]
    comps = [c.token_ids for r in rollouts for c in r.completions]
    logp = [c.logprobs for r in rollouts for c in r.completions]
    return TrainBatch(prompt_ids=prompt_ids, completion_ids=comps, advantages=[g.gauss(0, 1) for _ in comps],
                      behavior_logp=logp, ref_logp=[list(x) for x in logp] if with_ref else None, pad_id=pad_id)


def start_learners(ray, model: str, lcfg, algo, ranks: int, timeout_s: float):
    """`ranks` LearnerWorker actors (the config `lcfg`), ready: parts 2, 4 and 6 train and sync with them."""
    key, master = learner_port_key(), ray.util.get_node_ip_address()
    handles = [ray.remote(LearnerWorker).options(num_cpus=lcfg.num_cpus, num_gpus=lcfg.num_gpus, max_restarts=0)
               .remote(model, lcfg, algo, rank=r, world_size=ranks, master_addr=master, master_port=0, port_key=key,
                       total_steps=1000, seed=0) for r in range(ranks)]
    ray.get([h.info.remote() for h in handles], timeout=timeout_s)
    return handles


def bench_learner_and_sync(ray, model: str, base_cfg, stage: int, ranks: int, batch, steps: int, sync_repeats: int,
                           rollout_actor, n_params: int, peak_tflops: float | None, timeout_s: float):
    """Part 4 for one ZeRO stage, then part 2 (full weight updates into the rollout actor) with the same ranks."""
    lcfg = dataclasses.replace(base_cfg.learner, zero_stage=stage, num_ranks=ranks)
    progress(f"learner: ZeRO-{stage}, {ranks} rank(s), {len(batch)} sequences, 1 warm-up + {steps} steps")
    handles = start_learners(ray, model, lcfg, base_cfg.algo, ranks, timeout_s)
    group = LearnerGroup(handles, timeout_s)
    try:
        learner = None
        if steps > 0:
            group.train(batch)  # warm-up
            ms, walls = [], []
            for _ in range(steps):
                t = time.perf_counter()
                ms.append(group.train(batch))
                walls.append(time.perf_counter() - t)
            toks = sum(m["tokens"] for m in ms)
            secs = sum(m["seconds"] for m in ms)
            processed = sum(len(p) + len(c) for p, c in zip(batch.prompt_ids, batch.completion_ids)) * len(ms)
            gflops = per_second(6 * (n_params or 0) * processed, secs * 1e9)
            learner = {"stage": stage, "ranks": ranks, "seq": len(batch), "steps": steps, "tokens": toks,
                       "seconds": secs, "tokens_per_s": per_second(toks, secs),
                       "wall_tokens_per_s": per_second(toks, sum(walls)), "seconds_per_step": secs / len(ms),
                       "gflops": gflops, "mfu": ratio(gflops, peak_tflops * 1000) if peak_tflops else None,
                       "seconds_each": [round(m["seconds"], 4) for m in ms], "loss": [m.get("loss") for m in ms]}
        sync = None
        if rollout_actor is not None and sync_repeats > 0:
            backend = resolve_backend(base_cfg.rollout.weight_transfer_backend, base_cfg.rollout.num_gpus)
            progress(f"sync: ZeRO-{stage} rank 0 -> RolloutWorker, {backend}, 1 warm-up + {sync_repeats} full updates")
            group.init_weight_sync([rollout_actor], backend, base_cfg.rollout.bucket_mb, 1)
            outs, walls = [], []
            for v in range(sync_repeats + 1):
                t = time.perf_counter()
                outs.append(group.sync_weights(1000 * stage + v + 1))
                walls.append(time.perf_counter() - t)
            outs, walls = outs[1:], walls[1:]
            version = ray.get(rollout_actor.get_weight_version.remote(), timeout=timeout_s)
            sync = {"stage": stage, "ranks": ranks, "bytes": outs[0]["bytes"], "repeats": sync_repeats,
                    "seconds": statistics.median(o["seconds"] for o in outs), "wall_seconds": statistics.median(walls),
                    "mean_seconds": statistics.mean(o["seconds"] for o in outs),
                    "seconds_each": [round(o["seconds"], 4) for o in outs], "engine_version_after": version,
                    "bucket_mb": base_cfg.rollout.bucket_mb, "backend": backend, "transport": outs[0].get("transport"),
                    # the update's parts, median over the repeats (learner/weight_sync.py WeightSync.send)
                    "parts": {k: statistics.median(o["parts"][k] for o in outs) for k in outs[0].get("parts", {})}}
        return learner, sync
    finally:
        for h in handles:
            ray.kill(h)


class GlooPeer:
    """One end of the raw-broadcast baseline (a Ray actor): the same ProcessGroupGloo over a
    TCPStore that the weight transfer uses (actors.runtime.sockets.new_gloo_group)."""

    def __init__(self, rank: int):
        self.rank, self.store, self.group = rank, None, None

    def host_store(self) -> int:
        self.store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=300))
        return self.store.port

    def join(self, address: str, port: int, world_size: int) -> None:
        if self.store is None:
            self.store = dist.TCPStore(address, port, is_master=False, timeout=datetime.timedelta(seconds=300))
        self.group = new_gloo_group(dist.PrefixStore("raw/", self.store), self.rank, world_size, address, 300.0)

    def broadcast(self, nbytes: int, iters: int) -> list[float]:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if self.rank == 0:
            buf.fill_(7)
        times = []
        for _ in range(iters):
            self.group.barrier().wait()
            t = time.perf_counter()
            self.group.broadcast(buf, 0).wait()
            times.append(time.perf_counter() - t)
        return times


def bench_raw_broadcast(ray, nbytes: int, repeats: int, timeout_s: float) -> dict:
    """Part 2's baseline: one flat uint8 tensor of `nbytes`, rank 0 -> rank 1, two Ray actor processes."""
    progress(f"raw broadcast: {nbytes / 2**20:.2f} MiB over ProcessGroupGloo, 1 warm-up + {repeats}")
    cls = ray.remote(num_cpus=0.5)(GlooPeer)
    a, b = cls.remote(0), cls.remote(1)
    try:
        port = ray.get(a.host_store.remote(), timeout=timeout_s)
        addr = ray.util.get_node_ip_address()
        ray.get([a.join.remote(addr, port, 2), b.join.remote(addr, port, 2)], timeout=timeout_s)
        ta, tb = ray.get([a.broadcast.remote(nbytes, repeats + 1), b.broadcast.remote(nbytes, repeats + 1)],
                         timeout=timeout_s)
    finally:
        ray.kill(a)
        ray.kill(b)
    each = [max(x, y) for x, y in zip(ta[1:], tb[1:])]  # an iteration ends when both ends are done
    return {"bytes": nbytes, "repeats": repeats, "seconds": statistics.median(each), "mean_seconds": statistics.mean(each),
            "seconds_each": [round(x, 5) for x in each]}
