"""trainer.mode=pipeline, the driver's side: engines that never stop, groups scored as they arrive.

`PipelineFeeder` runs in a thread of the driver for the whole run. It keeps every engine supplied
with groups (prompts from the stream, `trainer.pipeline_groups_in_flight` in flight over all
engines), polls the engines for finished groups (actors/pipeline.py hands one back as soon as its
G completions are done), scores each arrival at once and, with a reference actor, takes its
log-probs then too. The training loop asks `next_batch` for the next `trainer.prompts_per_step`
scored groups in arrival order. Weight updates land in the engines while they run (the learner's
sync pauses each engine between two steps, actors/rollout.py); every token carries the version that
sampled it. A group whose oldest token is more than `trainer.max_staleness` versions behind the
learner is dropped at `next_batch` and its prompt generated again (counted: stale_groups).

An engine that died is revived by the pool (weights re-synced) and the groups it held are sent
again. Checkpoints record the data position past every prompt taken so far: groups in flight at a
checkpoint are not saved, and a resume does not generate them again (said and counted then).
"""
from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from cluster.driver.batch import Batch, CollectStats, score_groups, trim_to_ranks
from cluster.launch.waits import ActorFailed, wait_for

if TYPE_CHECKING:
    from cluster.config import RunConfig
    from cluster.data.dataset import Example, PromptStream
    from cluster.driver.worker_groups import RolloutPool

POLL_S = 0.02  # between two polls of the engines when none had anything


class PipelineFeeder:
    def __init__(self, cfg: RunConfig, stream: PromptStream, scorer, pool: RolloutPool, *, reference,
                 eos_id: int | None, weight_version: Callable[[], int]):
        self.cfg, self.stream, self.scorer, self.pool = cfg, stream, scorer, pool
        self.reference, self.eos_id, self.weight_version = reference, eos_id, weight_version
        t = cfg.trainer
        self.target = math.ceil((t.pipeline_groups_in_flight or 2 * t.prompts_per_step) / len(pool.handles))
        self._cv = threading.Condition()
        self._ready: collections.deque = collections.deque()  # (ScoredGroup, ref rows or None), arrival order
        self._again: collections.deque = collections.deque()  # examples to generate again (stale, lost)
        # per engine: key -> (example, pid of the engine process it was submitted to)
        self._held: list[dict[int, tuple[Example, int]]] = [{} for _ in pool.handles]
        self._next_key = 0
        self.stats = CollectStats()  # what was scored since the last batch (swapped by next_batch)
        self.stale_groups = 0  # dropped for max_staleness since the last batch, their prompts generated again
        self.requeued = 0  # groups lost with an engine that died, generated again
        self.engine = {"busy_s": 0.0, "wall_s": 0.0, "tokens": 0, "pause_s": 0.0, "in_flight": 0}
        self._last_engine: list[dict] = [{} for _ in pool.handles]
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pipeline-feeder", daemon=True)

    # ------------------------------------------------------------------ the loop's side
    def start(self) -> None:
        for w, h in enumerate(self.pool.handles):
            self._call(w, h.pipeline_start.remote, "starting its engine loop")
        self._thread.start()

    def next_batch(self, timeout_s: float) -> tuple[Batch, dict]:
        """The next prompts_per_step scored groups within trainer.max_staleness, as a Batch; and the
        engines' utilization since the last batch."""
        t, version = self.cfg.trainer, self.weight_version()
        want, groups, refs = t.prompts_per_step, [], []
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while len(groups) < want:
                if not self._ready:
                    self._raise_if_failed()
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"pipeline: {len(groups)} of {want} groups in {timeout_s:.0f}s "
                                           "(trainer.actor_timeout_s); the engines' logs are in the run dir")
                    self._cv.wait(timeout=1.0)
                    continue
                group, ref = self._ready.popleft()
                oldest = min((v for c in group.rollout.completions for v in c.versions), default=version)
                if version - oldest > t.max_staleness:
                    self.stale_groups += 1
                    self._again.append(group.example)
                    continue
                groups.append(group)
                refs.append(ref)
            kept = trim_to_ranks(groups, t.group_size, self.cfg.learner.num_ranks)
            for g, r in reversed(list(zip(groups[len(kept):], refs[len(kept):]))):
                self._ready.appendleft((g, r))  # trimmed: the first of the next batch
            stats, self.stats = self.stats, CollectStats()
            stale, self.stale_groups = self.stale_groups, 0
            state = self.stream.state()
            stats.gen_s = self.engine["busy_s"] / len(self.pool.handles)  # an engine's mean seconds generating
            engine = self._engine_since_last()
        batch = Batch.from_groups(kept, state, stats, version_if_empty=version,
                                  advantage_estimator=self.cfg.algo.advantage_estimator)
        if self.reference is not None and kept:
            batch.ref_logp = [row for r in refs[:len(kept)] for row in r]
        return batch, {"stale_groups": stale, **engine}

    def in_flight(self) -> int:
        with self._cv:
            return sum(len(h) for h in self._held) + len(self._ready)

    def stop(self) -> int:
        """Stop feeding and stop every engine's loop (aborting what runs); returns the groups lost."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=60)
        lost = self.in_flight()
        for w, h in enumerate(self.pool.handles):
            try:
                wait_for(h.pipeline_stop.remote(), f"rollout worker {w}", "stopping its engine loop",
                         self.cfg.trainer.actor_timeout_s)
            except ActorFailed:
                pass  # a dead engine runs nothing
        return lost

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"pipeline feeder failed: {type(self._error).__name__}: {self._error}") from self._error

    def _engine_since_last(self) -> dict:
        e, self.engine = self.engine, {"busy_s": 0.0, "wall_s": 0.0, "tokens": 0, "pause_s": 0.0,
                                       "in_flight": self.engine["in_flight"]}
        return {"pipeline/engine_busy_frac": e["busy_s"] / e["wall_s"] if e["wall_s"] > 0 else float("nan"),
                "pipeline/engine_tokens_per_s": e["tokens"] / (e["wall_s"] / len(self.pool.handles))
                if e["wall_s"] > 0 else float("nan"),
                "pipeline/queue_depth": e["in_flight"], "pipeline/pause_s": e["pause_s"] / len(self.pool.handles)}

    # ------------------------------------------------------------------ the feeding thread
    def _run(self) -> None:
        try:
            while not self._stop:
                self._top_up()
                if not self._poll():
                    time.sleep(POLL_S)
        except BaseException as e:  # noqa: BLE001 - raised by next_batch
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def _top_up(self) -> None:
        G = self.cfg.trainer.group_size
        for w, h in enumerate(self.pool.handles):
            with self._cv:
                n = self.target - len(self._held[w])
                if n <= 0:
                    continue
                examples = [self._again.popleft() for _ in range(min(n, len(self._again)))]
                examples += self.stream.take(n - len(examples))
                groups = []
                for ex in examples:
                    groups.append((self._next_key, ex.prompt_ids, G))
                    self._next_key += 1
            out = self._call(w, lambda h=h, groups=groups: h.pipeline_submit.remote(groups), "taking prompts")
            with self._cv:
                if out is None:  # the engine died: its replacement gets these on the next round
                    self._again.extend(examples)
                    continue
                for (key, _, _), ex in zip(groups, examples):
                    self._held[w][key] = (ex, out["pid"])

    def _call(self, w: int, call, what: str):
        """One call to engine w; None if it died (the pool revives it and re-syncs its weights; the
        groups it held are sent again once its replacement answers, `_lost_groups`)."""
        try:
            return wait_for(call(), f"rollout worker {w}", what, self.cfg.trainer.actor_timeout_s)
        except ActorFailed as e:
            if not e.died:
                raise
        self.pool.restarted_workers()  # revives each engine whose process changed, once (the sync may have already)
        return None

    def _lost_groups(self, w: int, pid: int) -> None:
        """Groups submitted to an earlier process of engine w (it died, Ray started another) are lost:
        generate them again. Called with the condition held."""
        lost = [key for key, (_, p) in self._held[w].items() if p != pid]
        if lost:
            self._again.extend(self._held[w].pop(key)[0] for key in lost)
            self._last_engine[w] = {}
            self.requeued += len(lost)
            print(f"rollout worker {w} was replaced; its {len(lost)} group(s) in flight are generated again", flush=True)

    def _poll(self) -> bool:
        """Take the finished groups of every engine, score them; True if any came."""
        arrived = []
        for w, h in enumerate(self.pool.handles):
            out = self._call(w, h.pipeline_take.remote, "returning finished groups")
            if out is None:
                continue
            with self._cv:
                self._lost_groups(w, out["pid"])
                for ro in out["rollouts"]:
                    held = self._held[w].pop(ro.prompt, None)
                    if held is not None:
                        ro.prompt = held[0].prompt_ids
                        arrived.append((held[0], ro))
                self._account(w, out)
        if arrived:
            self._score(arrived)
        return bool(arrived)

    def _account(self, w: int, out: dict) -> None:
        """The engine's counters since the last poll (they are running totals on the engine)."""
        s, last = out["stats"], self._last_engine[w]
        for key in ("busy_s", "wall_s", "tokens", "pause_s"):
            self.engine[key] += s[key] - last.get(key, 0)
        self._last_engine[w] = s
        self.engine["in_flight"] = sum(len(h) for h in self._held)

    def _score(self, arrived: list) -> None:
        t, m = self.cfg.trainer, self.cfg.metrics
        with self._cv:
            stats = self.stats
            t0 = time.perf_counter()
            groups = score_groups(self.scorer, arrived, t.group_size, stats,
                                  max_new_tokens=self.cfg.rollout.model_token_cap(), dynamic_sampling=t.dynamic_sampling,
                                  eos_id=self.eos_id, samples=m.completions_per_step if m.log_completions else 0,
                                  advantage_estimator=self.cfg.algo.advantage_estimator)
            stats.reward_s += time.perf_counter() - t0
        refs: list = [None] * len(groups)
        if self.reference is not None and groups and not stats.every_group_failed():
            t0 = time.perf_counter()
            rows = [r for g in groups for r in g.rollout.training_rows()]
            logp = wait_for(self.reference.logprobs.remote([r[0] for r in rows], [r[1] for r in rows]),
                            "reference actor", "computing reference log-probs", t.actor_timeout_s)
            G = t.group_size
            refs = [logp[i * G:(i + 1) * G] for i in range(len(groups))]
            stats.ref_s += time.perf_counter() - t0
        with self._cv:
            self._ready.extend(zip(groups, refs))
            self._cv.notify_all()
