"""Driver-side handles on the worker groups: a few coarse calls each, every wait bounded.

`RolloutPool` splits prompts across engines and survives an engine dying mid-call (Ray
restarts it; the pool re-syncs its weights and re-sends exactly the prompts it lost).
`LearnerGroup` fans each call out to every DeepSpeed rank (collectives need them all).
"""
from __future__ import annotations

import contextlib
import time

from actors.completions import PromptRollout, split_evenly
from actors.transport.registry import backend as transport_backend
from cluster.launch.waits import ActorFailed, wait_all, wait_for, wait_restarted
from learner.batch import TrainBatch


class LearnerGroup:
    def __init__(self, handles: list, timeout_s: float):
        self.handles, self.timeout_s = handles, timeout_s
        self.train_calls = 0  # train_step calls made to these actors (lend_threads names one)

    def _all(self, method: str, what: str, *args, timeout_s: float | None = None, **kwargs) -> list:
        refs = [getattr(h, method).remote(*args, **kwargs) for h in self.handles]
        return wait_all(refs, [f"learner rank {rank}" for rank in range(len(refs))], what, timeout_s or self.timeout_s)

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

    def sync_weights(self, version: int) -> dict:
        return self._all("sync_weights", f"sending weights version {version} to the engines", version)[0]

    def save(self, path: str, tag: str) -> None:
        self._all("save_checkpoint", f"saving checkpoint {tag}", path, tag)

    def load(self, path: str, tag: str) -> None:
        self._all("load_checkpoint", f"loading checkpoint {tag}", path, tag)

    def export_hf(self, out_dir: str) -> None:
        self._all("export_hf", f"exporting the model to {out_dir}", out_dir)


class RolloutPool:
    def __init__(self, handles: list, timeout_s: float, on_restart, pids: list[int]):
        """`on_restart(worker_index)` is called after a worker came back, before its prompts are re-sent
        (the driver re-syncs weights there). `pids` identify the live processes, to notice a restart."""
        self.handles, self.timeout_s, self.on_restart, self.pids = handles, timeout_s, on_restart, list(pids)
        self.restarts = 0

    def generate(self, prompts: list, group_size: int, seeds: list[int], greedy: bool = False,
                 expected_version: int | None = None, activity: str | None = None) -> list[PromptRollout]:
        """Every prompt's rollouts, in the original order; an engine that dies loses nothing.

        A worker that died mid-call, or that answers with an older weight version than
        `expected_version` (Ray restarted it between calls: it holds the base weights), is
        brought back to the current weights and its prompts are sent again. (A newer version
        is fine: a sync may land between the call being sent and served.) `activity`: what the waiting
        lines say ("{}": the engine's number of prompts), e.g. an evaluation's; None: generating.
        """
        return self._fan_out(
            len(prompts), activity or "generating {} prompts",
            lambda h, idx: h.generate.remote([prompts[i] for i in idx], group_size, [seeds[i] for i in idx], greedy),
            expected_version)

    def generate_multiturn(self, conversations: list[list[dict]], fields: list[dict], group_size: int,
                           seeds: list[int], greedy: bool = False, expected_version: int | None = None,
                           activity: str | None = None) -> list:
        """Every conversation's multi-turn rollouts (RolloutWorker.generate_multiturn), in order, with the
        same recovery as `generate`: a dead or restarted engine's share is sent again."""
        return self._fan_out(
            len(conversations), (activity or "running {} multi-turn conversations").replace("prompts", "conversations"),
            lambda h, idx: h.generate_multiturn.remote([conversations[i] for i in idx], [fields[i] for i in idx],
                                                       group_size, [seeds[i] for i in idx], greedy),
            expected_version)

    def _fan_out(self, n: int, what: str, call, expected_version: int | None) -> list:
        """`call(handle, indices)` on every engine with its share of n items; results in item order.
        An engine that died mid-call, or answers with a weight version older than `expected_version`
        (restarted between calls: base weights), is revived and its share sent again."""
        shares = split_evenly(list(range(n)), len(self.handles))
        results: dict = {}
        pending = {w: idx for w, idx in enumerate(shares) if idx}
        while pending:
            refs = {w: call(self.handles[w], idx) for w, idx in pending.items()}
            lost = {}
            for w, ref in refs.items():
                try:
                    out = wait_for(ref, f"rollout worker {w}", what.format(len(pending[w])), self.timeout_s)
                except ActorFailed as e:
                    if not e.died:
                        raise
                    lost[w] = pending[w]
                    continue
                if expected_version is not None and any(r.weight_version < expected_version for r in out):
                    lost[w] = pending[w]
                    continue
                results.update(zip(pending[w], out))
            for w in lost:
                self._revive(w)
            pending = lost  # re-send exactly the share the dead engine held
        return [results[i] for i in range(n)]

    def restarted_workers(self) -> list[int]:
        """Workers whose process changed since we last looked (after waiting for each to be up), revived."""
        infos = [wait_restarted(h, f"rollout worker {w}", self.timeout_s) for w, h in enumerate(self.handles)]
        out = [w for w, info in enumerate(infos) if info["pid"] != self.pids[w]]
        for w in out:
            self._revive(w, infos[w])
        return out

    def _revive(self, w: int, info: dict | None = None) -> None:
        """Record worker w's new process (waiting for it unless `info` already came from it), re-sync it."""
        info = info or wait_restarted(self.handles[w], f"rollout worker {w}", self.timeout_s)
        self.pids[w] = info["pid"]
        self.restarts += 1
        self.on_restart(w)


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
