"""Driver-side handles on the worker groups: a few coarse calls each, every wait bounded.

`RolloutPool` (cluster/driver/rollout_pool.py, re-exported here) splits prompts across the live
engines and survives losing some mid-call. `LearnerGroup` fans each call out to every DeepSpeed rank (collectives need them all).
"""
from __future__ import annotations

import contextlib
import time

from actors.transport.registry import backend as transport_backend
from cluster.driver.rollout_pool import RolloutPool
from cluster.launch.waits import wait_all
from learner.batch import TrainBatch

__all__ = ["LearnerGroup", "RolloutPool", "Stopwatch"]


class LearnerGroup:
    def __init__(self, handles: list, timeout_s: float):
        self.handles, self.timeout_s = handles, timeout_s
        self.train_calls = 0  # train_step calls made to these actors (lend_threads names one)

    def use(self, handles: list) -> None:
        """New ranks after the learner ranks restarted: this group's calls go to them, and their train calls
        count from 0 again. The group stays the one object the collector and the engines' weights hold."""
        self.handles, self.train_calls = handles, 0

    def _all(self, method: str, what: str, *args, timeout_s: float | None = None, watch=None, **kwargs) -> list:
        refs = [getattr(h, method).remote(*args, **kwargs) for h in self.handles]
        return wait_all(refs, [f"learner rank {rank}" for rank in range(len(refs))], what, timeout_s or self.timeout_s,
                        watch=watch)

    def train(self, batch: TrainBatch) -> dict:
        import ray

        ref = ray.put(batch)  # one copy in the object store, read by every rank
        self.train_calls += 1
        return self._all("train_step", "training a step", ref)[0]

    def lend_threads(self, call: int, threads: dict[int, int]) -> None:
        """Offer ranks {rank: threads} for the rest of train call number `call` (0-based), while it
        runs. Not waited for: a rank that died surfaces in that train call."""
        for rank, n in threads.items():
            self.handles[rank].lend_threads.options(concurrency_group="lend").remote(call, n)

    def init_weight_sync(self, rollout_handles: list, backend: str, bucket_mb: int, tensor_parallel: int) -> None:
        """(Re)build the transfer group: the sender (learner rank 0) + every vLLM worker of every engine."""

        # Each backend says what its ranks need (actors/transport/registry.py); the sender (learner
        # rank 0) fills in its own node's address.
        info = {"backend": backend, **transport_backend(backend).init_info(
            world_size=1 + len(rollout_handles) * tensor_parallel, bucket_bytes=bucket_mb << 20, timeout_s=self.timeout_s)}
        self._all("init_weight_sync", "connecting to the rollout engines", rollout_handles, info)

    def sync_weights(self, version: int, watch=None) -> dict:
        """`watch`: see wait_all (an engine lost with its host mid-transfer would hold it to its timeout)."""
        return self._all("sync_weights", f"sending weights version {version} to the engines", version, watch=watch)[0]

    def save(self, path: str, tag: str) -> None:
        self._all("save_checkpoint", f"saving checkpoint {tag}", path, tag)

    def load(self, path: str, tag: str) -> None:
        self._all("load_checkpoint", f"loading checkpoint {tag}", path, tag)

    def export_hf(self, out_dir: str) -> None:
        self._all("export_hf", f"exporting the model to {out_dir}", out_dir)


class Stopwatch:
    """`with sw("gen"): ...` adds the seconds to sw.t["gen_s"]."""

    def __init__(self):
        self.t: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.t[f"{name}_s"] = self.t.get(f"{name}_s", 0.0) + time.perf_counter() - t0
