"""6. LoRA: weight-sync bytes and seconds (adapter vs merged vs full) and the learner's optimizer
state, LoRA vs full fine-tuning, on the same model, batch and engine settings."""
from __future__ import annotations

import dataclasses
import statistics
import time

from actors.rollout import RolloutWorker
from actors.transport.registry import resolve_backend
from cluster.bench.learner_sync import start_learners
from cluster.bench.report import progress
from cluster.driver.worker_groups import LearnerGroup


def bench_lora(ray, model: str, base_cfg, batch, rank: int, repeats: int, timeout_s: float) -> dict:
    """One learner rank (ZeRO-2) per variant: a train step (so the optimizer state exists), then
    1 warm-up + `repeats` syncs into a RolloutWorker (with vLLM LoRA for the adapter variant)."""
    variants = {"full": {"lora_rank": 0},
                "adapter": {"lora_rank": rank, "lora_sync": "adapter"},
                "merged": {"lora_rank": rank, "lora_sync": "merged"}}
    backend = resolve_backend(base_cfg.rollout.weight_transfer_backend, base_cfg.rollout.num_gpus)
    out: dict = {"lora_rank": rank, "repeats": repeats, "backend": backend}
    engines: dict = {}
    try:
        for name, kw in variants.items():
            lcfg = dataclasses.replace(base_cfg.learner, zero_stage=2, num_ranks=1, **kw)
            key = lcfg.vllm_max_lora_rank()
            if key not in engines:
                engines[key] = ray.remote(RolloutWorker).options(num_cpus=base_cfg.rollout.num_cpus).remote(
                    model, base_cfg.rollout, max_lora_rank=key)
            engine = engines[key]
            progress(f"lora: {name} (rank {lcfg.lora_rank}), 1 train step, 1 warm-up + {repeats} syncs")
            handles = start_learners(ray, model, lcfg, base_cfg.algo, 1, timeout_s)
            group = LearnerGroup(handles, timeout_s)
            try:
                group.train(batch)
                group.init_weight_sync([engine], backend, base_cfg.rollout.bucket_mb, 1)
                outs, walls = [], []
                for v in range(repeats + 1):
                    t = time.perf_counter()
                    outs.append(group.sync_weights(100 * len(out) + v + 1))
                    walls.append(time.perf_counter() - t)
                info = ray.get(handles[0].info.remote(), timeout=timeout_s)
                out[name] = {"bytes": outs[-1]["bytes"],
                             "seconds": statistics.median(o["seconds"] for o in outs[1:]),
                             "wall_seconds": statistics.median(walls[1:]),
                             "optimizer_state_bytes": ray.get(handles[0].optimizer_state_bytes.remote(), timeout=timeout_s),
                             "trainable_params": info["trainable_params"], "total_params": info["total_params"]}
                progress(f"lora {name}: {out[name]['bytes'] / 2**20:.3f} MiB in {out[name]['seconds']:.4f} s, optimizer "
                     f"{out[name]['optimizer_state_bytes'] / 2**20:.3f} MiB")
            finally:
                for h in handles:
                    ray.kill(h)
    finally:
        for h in engines.values():
            ray.kill(h)
    return out
