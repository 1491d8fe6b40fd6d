"""trainer.mode=pipeline, the driver's side: engines that never stop, groups scored as they arrive.

`PipelineFeeder` runs in a thread of the driver for the whole run. It keeps every engine supplied
with groups (prompts from the stream, `trainer.pipeline_groups_in_flight` in flight over all
engines), polls the engines for finished groups (actors/pipeline.py hands one back as soon as its
G completions are done); a second thread scores each group as it arrives (on its own: a step's
metrics are those of the groups it trains on) and, with a reference actor, takes its log-probs.
The training loop asks `next_batch` for the next `trainer.prompts_per_step`
scored groups in arrival order. Weight updates land in the engines while they run (the learner's
sync pauses each engine between two steps, actors/rollout.py); every token carries the version that
sampled it. A group whose oldest token is more than `trainer.max_staleness` versions behind the
learner is dropped at `next_batch` and its prompt generated again (counted: stale_groups).

The engines fed are the pool's live ones, an elastic fleet as in the other schedules
(cluster/driver/rollout_pool.py), changed only from the training loop's thread (`next_batch`, or the
weight sync that failed on an engine): an engine that died is revived by the pool (weights re-synced)
and the groups submitted to its old process are sent again; one lost with its host leaves the fleet and
its groups are generated on the others; one that comes back or joins (a node with room) gets the
current weights, fingerprint verified, before it is given a group. The feeding thread leaves an engine
alone from its first failed call until the loop's thread has dealt with it (a call to an engine whose
host is gone could wait out trainer.actor_timeout_s).

A checkpoint records the data position past every prompt taken so far and the prompts
taken and not trained on, in the order taken (`checkpoint_state`); not their partial generations, whose
tokens came from weights a resume no longer has: a resumed run generates those prompts again first (said
and counted then, `pipeline/regenerated_on_resume`), so it asks for the prompts the stopped run had in flight.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
from typing import TYPE_CHECKING

from cluster.driver.batch import Batch, CollectStats, score_groups, trim_to_ranks
from cluster.driver.pipeline_bounds import POLL_S, in_flight_bound
from cluster.launch.waits import ActorFailed, wait_for

if TYPE_CHECKING:
    from cluster.config import RunConfig
    from cluster.data.dataset import Example, PromptStream
    from cluster.driver.engine_weights import WeightVersions
    from cluster.driver.reference import ReferenceLogprobs
    from cluster.driver.worker_groups import RolloutPool

WAITING_LINE_S = 30.0  # next_batch says what it waits for (each engine's groups and its last answer) this often
STOP_JOIN_S = 5.0  # at most this for the feeder's threads to end (daemons: one in a call to a hung engine is left)


class PipelineFeeder:
    def __init__(self, cfg: RunConfig, stream: PromptStream, scorer, pool: RolloutPool, *,
                 reference: ReferenceLogprobs | None, eos_id: int | None, versions: WeightVersions):
        """`reference`: the reference's log-probs of the groups kept (cluster/driver/reference.py; None: no reference
        actor); `versions`: the run's weight versions (the learner's, which a group's staleness is measured against)."""
        self.cfg, self.stream, self.scorer, self.pool = cfg, stream, scorer, pool
        self.reference, self.eos_id, self.versions = reference, eos_id, versions
        t, m = cfg.trainer, cfg.metrics
        self._feeding: list[int] = list(pool.live)  # the engines supplied: the pool's live ones, once up to date
        self._failed: set[int] = set()  # engines a call found dead, not yet revived or out of the fleet
        self._hung: dict = {}  # of those, the ones that answered nothing in time: engine -> its ActorFailed
        self.samples_per_group = math.ceil(m.completions_per_step / t.prompts_per_step) if m.log_completions else 0
        self._cv = threading.Condition()
        self._arrived: list = []  # (example, rollout) taken from the engines, not yet scored
        self._ready: collections.deque = collections.deque()  # (ScoredGroup, ref rows or None, its stats)
        self._again: collections.deque = collections.deque()  # examples to generate again (stale, lost)
        # every example taken from the stream and not yet trained on (nor dropped by dynamic sampling),
        # in the order taken: what a checkpoint records as in flight
        self._untrained: list[Example] = []
        # per engine: key -> (example, pid of the engine process it was submitted to)
        self._held: list[dict[int, tuple[Example, int]]] = [{} for _ in pool.handles]
        self._next_key = 0
        self._unclaimed = CollectStats()  # groups scored and not trained on (dynamic sampling, stale)
        self.requeued = 0  # groups lost with an engine that died, generated again
        self._revive = False  # an engine died or came back as another process: next_batch deals with it
        self.engine = {"busy_s": 0.0, "wall_s": 0.0, "tokens": 0, "pause_s": 0.0, "in_flight": 0}
        self._last_engine: list[dict] = [{} for _ in pool.handles]
        self._last_back = [time.monotonic()] * len(pool.handles)  # when each engine last handed a group back
        self._stop = False
        self._error: BaseException | None = None
        self._threads = [threading.Thread(target=self._guarded, args=(self._feed,), name="pipeline-feed", daemon=True),
                         threading.Thread(target=self._guarded, args=(self._scoring,), name="pipeline-score", daemon=True)]

    # ------------------------------------------------------------------ the loop's side
    def start(self) -> None:
        for w in self._feeding:
            wait_for(self.pool.handles[w].pipeline_start.remote(), f"rollout worker {w}", "starting its engine loop",
                     self.cfg.trainer.actor_timeout_s)
        for th in self._threads:
            th.start()

    def next_batch(self, timeout_s: float) -> tuple[Batch, dict]:
        """The next prompts_per_step scored groups within trainer.max_staleness, in arrival order, as a
        Batch; and the pipeline's metrics since the last batch (cluster/run/metrics.py PIPELINE_KEYS)."""
        t, version = self.cfg.trainer, self.versions.learner
        want, taken, stale = t.prompts_per_step, [], 0
        start = time.monotonic()
        deadline, say_at = start + timeout_s, start + WAITING_LINE_S
        self._check_fleet()  # an engine back, or new on a node that joined, is fed from this batch on
        with self._cv:
            while len(taken) < want:
                if self._revive:  # from this thread only: the weight sync changes the fleet here too
                    self._cv.release()
                    try:
                        self._check_fleet()
                    finally:
                        self._cv.acquire()
                    continue
                if not self._ready:
                    self._raise_if_failed()
                    now = time.monotonic()
                    if now > deadline:
                        raise TimeoutError(f"pipeline: {len(taken)} of {want} groups in {timeout_s:.0f}s "
                                           f"(trainer.actor_timeout_s); {self._engines_waited_on(now)}; the engines' "
                                           "logs are in the run dir")
                    if now >= say_at:
                        say_at = now + WAITING_LINE_S
                        print(f"pipeline: waiting for groups, {len(taken)} of {want} after {now - start:.0f}s (at most "
                              f"{timeout_s:.0f}s, trainer.actor_timeout_s); {self._engines_waited_on(now)}", flush=True)
                    self._cv.wait(timeout=1.0)
                    continue
                group, ref, stats = self._ready.popleft()
                oldest = min((v for c in group.rollout.completions for v in c.versions), default=version)
                if version - oldest > t.max_staleness:  # too old to train on: its prompt is generated again
                    stale += 1
                    self._again.append(group.example)
                    self._unclaimed.merge(dataclasses.replace(stats, samples=[]))
                    continue
                taken.append((group, ref, stats))
            groups = trim_to_ranks([g for g, _, _ in taken], t.group_size, self.cfg.learner.num_ranks)
            for item in reversed(taken[len(groups):]):
                self._ready.appendleft(item)  # trimmed: the first of the next batch
            taken = taken[:len(groups)]
            for g, _, _ in taken:
                self._forget(g.example)
            stats, self._unclaimed = self._unclaimed, CollectStats()
            for i, (_, _, st) in enumerate(taken):
                for row in st.samples:
                    row["prompt_index"] = i
                stats.merge(st)
            stats.samples = stats.samples[:self.cfg.metrics.completions_per_step]
            stats.gen_s = self.engine["busy_s"] / max(1, len(self._feeding))  # an engine's mean seconds generating
            state = self.stream.state()
            engine = self._engine_since_last()
        batch = Batch.from_groups(groups, state, stats, version_if_empty=version,
                                  advantage_estimator=self.cfg.algo.advantage_estimator)
        if self.reference is not None and groups:
            batch.ref_logp = [row for _, ref, _ in taken for row in ref]
        return batch, {"stale_groups": stale, **engine}

    def _engines_waited_on(self, now: float) -> str:
        """Each engine fed: the groups it holds and when it last handed one back (called with the condition held);
        the one silent longest while holding groups is named first, as the one to look at."""
        fed = [w for w in self._feeding if w in self.pool.live]
        silent = {w: now - self._last_back[w] for w in fed if self._held[w]}
        parts = [f"rollout worker {w}: {len(self._held[w])} group(s) in flight, "
                 + (f"none back for {silent[w]:.0f}s" if w in silent else "nothing asked of it") for w in fed]
        if silent:
            worst = max(silent, key=silent.get)
            parts.insert(0, f"rollout worker {worst} has answered nothing for the longest ({silent[worst]:.0f}s)")
        return "; ".join(parts) or "no engine is fed"

    def _check_fleet(self) -> None:
        """From the loop's thread: every engine whose host was lost leaves the fleet (below rollout.min_workers
        the pool waits for room, or raises); one a call found dead is revived where Ray restarted it, or leaves
        with its host; one that came back as another process between calls is re-synced; one back or new on a
        node with room gets the current weights, verified (RolloutPool.rejoin). Then the groups held by engines
        that left are generated again on the others, and the feeding thread supplies the live engines."""
        pool = self.pool
        with self._cv:
            revive, self._revive = self._revive, False
            failed, hung, self._hung = sorted(self._failed), self._hung, {}
        if revive:  # a call failed, or an engine answered as another process
            for w in pool.lost_with_host():
                pool.leave(w)
            for w in failed:  # first: asked again, one whose host is gone would hold the call until Ray says so
                if w in pool.live and w in hung:
                    pool.hung(w, hung[w])  # leaves the fleet as a lost host's engine does, or raises at min_workers
                elif w in pool.live:
                    pool.recover(w)
            pool.recover_all("answering after a call of the pipeline failed or came from a new process")
        pool.rejoin()
        with self._cv:
            for w in self._feeding:
                if w not in pool.live and self._held[w]:
                    lost = [ex for ex, _ in self._held[w].values()]
                    self._held[w].clear()
                    self._again.extend(lost)
                    self.requeued += len(lost)
                    print(f"rollout worker {w} left the fleet; its {len(lost)} group(s) in flight are generated on "
                          "the others", flush=True)
            self._feeding = list(pool.live)
            self._failed -= set(failed)

    def checkpoint_state(self) -> dict:
        """The data position past every prompt taken so far, with the prompts taken and not trained on (in an
        engine, back and not yet trained on, or waiting to be generated again) as its in_flight, in the order
        taken: a stream loaded from it hands them out first."""
        with self._cv:
            return self.stream.state(in_flight=self._untrained)

    def _forget(self, example: Example) -> None:
        """`example` was trained on or dropped (called with the condition held). The same example may be in
        flight twice (a small data set's next epoch): either is the same prompt."""
        for i, e in enumerate(self._untrained):
            if e is example:
                del self._untrained[i]
                return

    def _pending(self) -> int:
        return sum(len(h) for h in self._held) + len(self._arrived) + len(self._ready) + len(self._again)

    def stop(self, wait_s: float | None = None) -> None:
        """Stop feeding and every engine's loop (aborting what runs); `checkpoint_state` still says what was
        in flight. `wait_s`: at most this for each engine to answer (None: trainer.actor_timeout_s); a run
        stopping on a signal passes what is left of trainer.stop_grace_s (the engines are torn down next)."""
        wait_s = self.cfg.trainer.actor_timeout_s if wait_s is None else wait_s
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for th in self._threads:
            if th.is_alive():
                th.join(timeout=min(STOP_JOIN_S, wait_s))
        for w in self._supplied():  # not one found dead or out of the fleet: it runs nothing
            try:
                wait_for(self.pool.handles[w].pipeline_stop.remote(), f"rollout worker {w}", "stopping its engine loop",
                         wait_s)
            except ActorFailed:
                pass  # a dead engine (or one that does not answer in time) runs nothing the run still needs

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"pipeline feeder failed: {type(self._error).__name__}: {self._error}") from self._error

    def _engine_since_last(self) -> dict:
        e, n = self.engine, max(1, len(self._feeding))
        self.engine = {"busy_s": 0.0, "wall_s": 0.0, "tokens": 0, "pause_s": 0.0, "in_flight": e["in_flight"]}
        # (a step is counted when it ends, so a step that straddles two polls could lift the share over 1)
        return {"pipeline/engine_busy_frac": min(1.0, e["busy_s"] / e["wall_s"]) if e["wall_s"] > 0 else float("nan"),
                "pipeline/engine_tokens_per_s": e["tokens"] / (e["wall_s"] / n) if e["wall_s"] > 0 else float("nan"),
                "pipeline/queue_depth": e["in_flight"], "pipeline/pause_s": e["pause_s"] / n}

    # ------------------------------------------------------------------ the threads
    def _guarded(self, loop) -> None:
        try:
            loop()
        except BaseException as e:  # noqa: BLE001 - raised by next_batch
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def _feed(self) -> None:
        """Keep every engine supplied; take back what finished."""
        while not self._stop:
            self._top_up()
            if not self._poll():
                time.sleep(POLL_S)

    def _supplied(self) -> list[int]:
        """The engines the feeding thread calls now: the live ones, less those a call found dead (and those the
        weight sync took out of the fleet since: next_batch moves their groups)."""
        with self._cv:
            return [w for w in self._feeding if w not in self._failed and w in self.pool.live]

    def _top_up(self) -> None:
        G = self.cfg.trainer.group_size
        feeding = self._supplied()
        target = math.ceil(in_flight_bound(self.cfg.trainer) / max(1, len(feeding)))  # per engine
        for w in feeding:
            h = self.pool.handles[w]
            with self._cv:
                # in flight = in an engine, or back and not yet trained on: the engines run at most this far ahead
                budget = target * len(feeding) - self._pending() + len(self._again)
                n = min(target - len(self._held[w]), budget)
                if n <= 0:
                    continue
                examples = [self._again.popleft() for _ in range(min(n, len(self._again)))]
                fresh = self.stream.take(n - len(examples))
                self._untrained += fresh
                examples += fresh
                groups = []
                for ex in examples:
                    groups.append((self._next_key, ex.prompt_ids, G))
                    self._next_key += 1
            out = self._call(w, lambda h=h, groups=groups: h.pipeline_submit.remote(groups), "taking prompts")
            with self._cv:
                if out is None:  # the engine died: its replacement gets these
                    self._again.extend(examples)
                    continue
                if not self._held[w]:  # its wait for a group back starts now
                    self._last_back[w] = time.monotonic()
                for (key, _, _), ex in zip(groups, examples):
                    self._held[w][key] = (ex, out["pid"])

    def _call(self, w: int, call, what: str):
        """One call to engine w; None if it died (left alone until next_batch has the pool revive it, or take it
        out of the fleet with its host)."""
        try:
            return wait_for(call(), f"rollout worker {w}", what, self.cfg.trainer.actor_timeout_s)
        except ActorFailed as e:
            with self._cv:
                if not e.died:  # hung on a live node: next_batch has the pool take it out of the fleet (issue 59)
                    self._hung[w] = e
                self._failed.add(w)
                self._revive = True
                self._cv.notify_all()
        return None

    def _lost_groups(self, w: int, pid: int) -> None:
        """Groups submitted to an earlier process of engine w (it died, Ray started another) are lost:
        generate them again. Called with the condition held."""
        if pid != self.pool.pids[w]:
            self._revive = True  # the new process has not been brought to the current weights yet
        lost = [key for key, (_, p) in self._held[w].items() if p != pid]
        if lost:
            self._again.extend(self._held[w].pop(key)[0] for key in lost)
            self.requeued += len(lost)
            print(f"rollout worker {w} was replaced; its {len(lost)} group(s) in flight are generated again", flush=True)

    def _poll(self) -> bool:
        """Take the finished groups of every engine; True if any came."""
        arrived = []
        for w in self._supplied():
            out = self._call(w, self.pool.handles[w].pipeline_take.remote, "returning finished groups")
            if out is None:
                continue
            with self._cv:
                self._lost_groups(w, out["pid"])
                if out["rollouts"]:
                    self._last_back[w] = time.monotonic()
                for ro in out["rollouts"]:
                    held = self._held[w].pop(ro.prompt, None)
                    if held is not None:
                        ro.prompt = held[0].prompt_ids
                        arrived.append((held[0], ro))
                self._account(w, out)
        if arrived:
            with self._cv:
                self._arrived += arrived
                self._cv.notify_all()
        return bool(arrived)

    def _account(self, w: int, out: dict) -> None:
        """The engine's counters since the last poll (they are running totals of its process: a replaced
        engine's new process counts from 0, whether or not the old one held groups when it died)."""
        s, last = out["stats"], self._last_engine[w]
        if last.get("pid") != out["pid"]:
            last = {}
        for key in ("busy_s", "wall_s", "tokens", "pause_s"):
            self.engine[key] += s[key] - last.get(key, 0)
        self._last_engine[w] = {**s, "pid": out["pid"]}
        self.engine["in_flight"] = sum(len(h) for h in self._held)

    def _scoring(self) -> None:
        """Score each group as it arrives, on its own; then the reference's log-probs of those kept."""
        t = self.cfg.trainer
        while True:
            with self._cv:
                while not self._arrived and not self._stop:
                    self._cv.wait(timeout=0.5)
                if self._stop:
                    return
                arrived, self._arrived = self._arrived, []
            kept = []
            for ex, ro in arrived:
                stats, t0 = CollectStats(), time.perf_counter()
                groups = score_groups(self.scorer, [(ex, ro)], t.group_size, stats,
                                      max_new_tokens=self.cfg.rollout.model_token_cap(),
                                      dynamic_sampling=t.dynamic_sampling, eos_id=self.eos_id,
                                      samples=self.samples_per_group)
                stats.reward_s += time.perf_counter() - t0
                if groups:
                    kept.append((groups[0], stats))
                else:  # no learning signal (dynamic sampling): counted in the next step, not trained on
                    with self._cv:
                        self._unclaimed.merge(dataclasses.replace(stats, samples=[]))
                        self._forget(ex)
            refs: list = [None] * len(kept)
            if self.reference is not None and kept:
                t0 = time.perf_counter()
                rows = [r for g, _ in kept for r in g.rollout.training_rows()]
                prompts, completions = [r[0] for r in rows], [r[1] for r in rows]
                logp = self.reference(prompts, completions)
                G = t.group_size
                refs = [logp[i * G:(i + 1) * G] for i in range(len(kept))]
                kept[0][1].ref_s += time.perf_counter() - t0
            with self._cv:
                self._ready.extend((g, ref, st) for (g, st), ref in zip(kept, refs))
                self._cv.notify_all()
