"""trainer.mode=pipeline, the parts without engines: the feeder's staleness rule and batch, the prompts in
flight a checkpoint records, the config's refusals, per-token version metrics, AReaL's decoupled objective."""
from __future__ import annotations

import dataclasses
import os
import re
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from actors.completions import Completion, PromptRollout
from cluster.config import RunConfig
from cluster.data.dataset import Example, PromptStream
from cluster.driver.batch import Batch, CollectStats, ScoredGroup
from cluster.driver.engine_weights import WeightVersions
from cluster.driver.pipeline import PipelineFeeder
from cluster.driver.step_row import version_metrics
from cluster.launch.waits import ActorFailed
from cluster.run.resume import resume_point
from cluster.run.stopping import Interrupted, StopSignals
from learner.config import AlgoConfig
from learner.grpo import LossInputs, decoupled_weights, no_correction, policy_loss, tis_weights
from tests.unit.test_collect import checkpointing_trainer


def group(name: str, versions: list[list[int]]) -> ScoredGroup:
    comps = [Completion([5] * len(v), [-1.0] * len(v), "x", "stop", versions=v) for v in versions]
    return ScoredGroup(Example(name, prompt_ids=[1, 2]), PromptRollout([1, 2], [1, 2], comps, min(map(min, versions))),
                       [float(i) for i in range(len(versions))])


class FakePool:
    """What the feeder uses of RolloutPool (cluster/driver/rollout_pool.py), engines faked: `lost` engines'
    host is dead in Ray's node table, `dying` ones die while recover_all asks them (their host lost, not yet
    marked dead), `joining` ones are placed on a node that joined. `live`: those that generate from the start
    (an elastic start's fewer)."""

    def __init__(self, engines: int = 1, live: list[int] | None = None):
        self.handles = [SimpleNamespace(name=f"engine {w}") for w in range(engines)]
        self.live = list(range(engines)) if live is None else live
        self.pids = [1] * engines
        self.lost: set[int] = set()
        self.dying: set[int] = set()
        self.joining: set[int] = set()
        self.events: list = []
        self.on_rejoin = lambda w: None

    def lost_with_host(self):
        return [w for w in sorted(self.lost) if w in self.live]

    def leave(self, w):
        self.live.remove(w)
        self.events.append(("leave", w))

    def recover(self, w):
        if w in self.lost or w in self.dying:  # RolloutPool.recover waits until Ray marks the host dead
            self.leave(w)
            return False
        self.events.append(("revive", w))
        return True

    def hung(self, w, error):
        """As RolloutPool.hung: it leaves while more than min_live (1 here) generate, else the error is raised."""
        if len(self.live) <= 1:
            raise error
        self.leave(w)

    def recover_all(self, activity):
        """As RolloutPool.recover_all: every live engine asked; one that died since is recovered."""
        self.events.append(("recover_all", tuple(self.live)))
        for w in [w for w in self.live if w in self.dying]:
            self.recover(w)
        return False

    def rejoin(self):
        back = sorted(self.joining)
        for w in back:  # as RolloutPool.rejoin: live first, then the weights (on_rejoin)
            self.live = sorted([*self.live, w])
            self.on_rejoin(w)
            self.events.append(("rejoin", w))
        self.joining.clear()
        return back


def feeder(version: int, stream=None, pool=None, **trainer) -> PipelineFeeder:
    cfg = RunConfig()
    cfg.trainer = dataclasses.replace(cfg.trainer, mode="pipeline", group_size=2, prompts_per_step=2, **trainer)
    stream = stream or SimpleNamespace(state=lambda: {"epoch": 0, "index": 7})
    return PipelineFeeder(cfg, stream, scorer=None, pool=pool or FakePool(), reference=None, eos_id=None,
                          versions=WeightVersions(learner=version))


def test_next_batch_takes_groups_in_arrival_order_and_regenerates_the_stale_ones():
    f = feeder(version=5, max_staleness=2)
    def stats(tokens):
        return CollectStats(gen_tokens=tokens, samples=[{"prompt_index": 0, "tokens": tokens}])

    f._ready.extend([(group("a", [[5, 5], [4, 5]]), None, stats(4)), (group("old", [[2, 5], [5, 5]]), None, stats(4)),
                     (group("b", [[3, 4], [4]]), None, stats(3)), (group("c", [[5], [5]]), None, stats(2))])
    f.pool.pids = [1]
    batch, extra = f.next_batch(timeout_s=1)
    assert [e.prompt for e in batch.examples] == ["a", "b"]  # "old" has a token 3 versions behind
    assert extra["stale_groups"] == 1 and [e.prompt for e in f._again] == ["old"]  # its prompt is generated again
    assert batch.token_versions == [[5, 5], [4, 5], [3, 4], [4]] and batch.weight_version == 3
    # the step's stats: its groups' and the stale one's (whose logged samples are not the step's)
    assert batch.stats.gen_tokens == 11 and batch.stats.samples == [{"prompt_index": 0, "tokens": 4},
                                                                     {"prompt_index": 1, "tokens": 3}]
    assert batch.stream_state == {"epoch": 0, "index": 7}
    assert [g.example.prompt for g, _, _ in f._ready] == ["c"]  # the next batch starts there
    m = version_metrics(batch, trained_from=5)
    assert m == {"staleness/token_mean": pytest.approx((0 + 0 + 1 + 0 + 2 + 1 + 1) / 7), "staleness/token_max": 2,
                 "versions_per_sequence_mean": (1 + 2 + 2 + 1) / 4}


def steady_state_drops(max_staleness: int, in_flight: int, steps: int = 8) -> int:
    """Groups dropped as stale when the engines keep up with the learner: every group admitted finishes
    before the next update, on the weights the engine holds then (2 prompts per step)."""
    examples = [Example(f"p{i}", prompt_ids=[1, i]) for i in range(100)]
    f = feeder(version=0, stream=PromptStream(examples, seed=0), max_staleness=max_staleness,
               pipeline_groups_in_flight=in_flight)
    now = f.versions  # the learner's version, which the loop moves
    f._call = lambda w, call, what: {"pid": 1}
    f.pool.pids = [1]

    def generate():  # the engine takes what the bound allows and finishes it on its current weights
        f._top_up()
        for key, (ex, _) in list(f._held[0].items()):
            del f._held[0][key]
            v = now.learner
            f._ready.append((group(ex.prompt, [[v], [v]])._replace(example=ex), None, CollectStats()))

    generate()
    dropped = 0
    for _ in range(steps):
        _, extra = f.next_batch(timeout_s=1)
        dropped += extra["stale_groups"]
        generate()  # while the step trains, on the weights before its update
        now.learner += 1  # the update
    return dropped


def test_the_default_bound_admits_no_group_that_would_only_go_stale():
    """trainer.pipeline_groups_in_flight 0 resolves to max_staleness x prompts_per_step: with engines that
    keep up, nothing is generated only to be dropped. One batch more in flight and groups wait a step longer
    in the queue: here one of the two a step is dropped and generated again (the bench measured 161 dropped
    for 192 trained in 12 steps)."""
    assert steady_state_drops(max_staleness=1, in_flight=0) == 0
    assert steady_state_drops(max_staleness=2, in_flight=0) == 0
    assert steady_state_drops(max_staleness=1, in_flight=4, steps=16) >= 14  # twice the bound: one a step
    assert steady_state_drops(max_staleness=2, in_flight=6, steps=16) >= 8


def test_a_checkpoint_records_the_prompts_in_flight_in_the_order_taken():
    """Taken from the stream and not trained on (still in an engine, or dropped as stale and waiting to be
    generated again): recorded, in the order taken, so a resume asks for them first; trained ones are not."""
    examples = [Example(f"p{i}", prompt_ids=[1, i]) for i in range(10)]
    f = feeder(version=3, stream=PromptStream(examples, seed=0), max_staleness=1, pipeline_groups_in_flight=4)
    f._call = lambda w, call, what: {"pid": 1}  # the engine took the groups
    f._top_up()
    taken = [ex for ex, _ in f._held[0].values()]
    assert len(taken) == 4 and f.checkpoint_state()["in_flight"] == [examples.index(e) for e in taken]

    def back(ex, versions):  # what _poll and the scoring thread do with a finished group
        key = next(k for k, (e, _) in f._held[0].items() if e is ex)
        del f._held[0][key]
        g = group(ex.prompt, versions)
        f._ready.append((g._replace(example=ex), None, CollectStats()))

    back(taken[2], [[3], [3]])
    back(taken[0], [[1], [3]])  # 2 versions behind: dropped at next_batch, its prompt generated again
    back(taken[1], [[2], [3]])
    f.pool.pids = [1]
    batch, extra = f.next_batch(timeout_s=1)
    assert batch.examples == [taken[2], taken[1]] and extra["stale_groups"] == 1
    state = f.checkpoint_state()
    assert state == {"epoch": 0, "index": 4, "in_flight": [examples.index(taken[0]), examples.index(taken[3])]}
    resumed = PromptStream(examples, seed=0)
    resumed.load_state(state)
    assert resumed.take(3) == [taken[0], taken[3], PromptStream(examples, seed=0).take(5)[4]]


def test_a_replaced_engines_counters_start_from_zero_even_when_it_held_no_group():
    """The engine's busy/wall/token/pause seconds are running totals of its process. The e2e run's step
    after a replaced engine logged gen_s -21.8 and a NaN busy share: the new process's totals were taken
    from the old one's whenever no group was lost with it."""
    f = feeder(version=0)
    f.pool.pids = [1]
    f._account(0, {"pid": 1, "stats": {"busy_s": 8.0, "wall_s": 10.0, "tokens": 300, "pause_s": 0.5}})
    f._account(0, {"pid": 1, "stats": {"busy_s": 9.0, "wall_s": 12.0, "tokens": 340, "pause_s": 0.5}})
    f._account(0, {"pid": 2, "stats": {"busy_s": 1.0, "wall_s": 2.0, "tokens": 40, "pause_s": 0.0}})
    assert (f.engine["busy_s"], f.engine["wall_s"], f.engine["tokens"], f.engine["pause_s"]) == (10.0, 14.0, 380, 0.5)
    m = f._engine_since_last()
    assert m["pipeline/engine_busy_frac"] == pytest.approx(10 / 14) and m["pipeline/engine_tokens_per_s"] == 380 / 14


def test_merged_stats_add_every_count():
    a = CollectStats(rewards=[1.0], gen_tokens=3, reward_functions={"f": {"values": [1.0], "errors": 0, "unscorable": 0,
                     "calls": 1, "timeouts": 0, "seconds": 0.5, "truncated": None}})
    b = CollectStats(rewards=[0.0], gen_tokens=4, reward_errors=1, error_samples=["boom"],
                     reward_functions={"f": {"values": [0.0], "errors": 1, "unscorable": 0, "calls": 1, "timeouts": 0,
                                             "seconds": 0.25, "truncated": None, "first_error": "boom"}})
    a.merge(b)
    assert a.rewards == [1.0, 0.0] and a.gen_tokens == 7 and a.reward_errors == 1 and a.error_samples == ["boom"]
    assert a.reward_functions["f"] == {"values": [1.0, 0.0], "errors": 1, "unscorable": 0, "calls": 2, "timeouts": 0,
                                       "seconds": 0.75, "truncated": None, "first_error": "boom"}


def test_next_batch_says_when_no_group_comes():
    with pytest.raises(TimeoutError, match="0 of 2 groups"):
        feeder(version=0).next_batch(timeout_s=0.01)


def test_sync_and_async_batches_have_the_rollouts_version_on_every_token():
    comps = [Completion([3, 4], [0.0, 0.0], "", "stop"), Completion([3], [0.0], "", "stop")]
    b = Batch.from_groups([ScoredGroup(Example("p"), PromptRollout([1], [1], comps, 2), [1.0, 0.0])], {}, CollectStats(),
                          0, "grpo")
    assert b.token_versions is None and b.versions() == [[2, 2], [2]]
    assert version_metrics(b, trained_from=3) == {"staleness/token_mean": 1, "staleness/token_max": 1,
                                                   "versions_per_sequence_mean": 1}


@pytest.mark.parametrize("override, problem", [
    ({"trainer.max_staleness": 0}, "set trainer.max_staleness >= 1"),
    ({"trainer.eval_every": 2}, "does not support evaluations during training"),
    ({"rollout.stop": ["\n"]}, "does not support rollout.stop strings"),
    ({"rollout.kv_after_update": "drop"}, "rollout.kv_after_update must be recompute|keep"),
    ({"trainer.max_staleness": 10**9}, "trainer.max_staleness=1000000000 is above 1000: a bound that large is none"),
    ({"trainer.pipeline_groups_in_flight": 10**6}, "trainer.pipeline_groups_in_flight=1000000 is above 64 x "
                                                   "trainer.prompts_per_step"),
])
def test_pipeline_config_names_what_it_does_not_support(override, problem):
    cfg = RunConfig()
    cfg.trainer.mode = "pipeline"
    for key, value in override.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    assert any(problem in p for p in cfg.problems()), cfg.problems()


def test_decoupled_objective_leaves_out_tokens_above_the_cap_where_tis_truncates():
    old = torch.tensor([[0.0, 0.0, 0.0]])
    behav = torch.tensor([[0.0, -0.5, -2.0]])  # ratios 1, e^0.5 = 1.65, e^2 = 7.4
    assert torch.allclose(tis_weights(old, behav, 2.0), torch.tensor([[1.0, 1.6487213, 2.0]]))
    assert torch.allclose(decoupled_weights(old, behav, 2.0), torch.tensor([[1.0, 1.6487213, 0.0]]))
    assert torch.allclose(decoupled_weights(old, behav, None), torch.exp(old - behav))
    logp = torch.zeros(1, 3, requires_grad=True)
    inputs = LossInputs(logp, logp.detach(), torch.tensor([1.0]), torch.ones(1, 3), behavior_logp=behav)
    loss_tis, m_tis = policy_loss(inputs, AlgoConfig())
    loss_dec, m_dec = policy_loss(inputs, AlgoConfig(behavior_correction="decoupled"))
    assert loss_tis.item() == pytest.approx(-(1 + 1.6487213 + 2) / 3)
    assert loss_dec.item() == pytest.approx(-(1 + 1.6487213) / 3)
    assert "unknown behavior_correction" in str(pytest.raises(ValueError, policy_loss, inputs,
                                                              AlgoConfig(behavior_correction="x")).value)
    assert any("algo.behavior_correction must be tis|decoupled|none" in p
               for p in AlgoConfig(behavior_correction="x").problems())


def test_no_correction_trains_stale_tokens_as_on_policy_whatever_the_cap():
    """behavior_correction=none is the comparison run's "off": weight 1 on every token, the sampler's log-probs
    unread, the same loss and gradient as TIS turned off with tis_cap=null, and unlike TIS's."""
    old = torch.tensor([[0.0, 0.0, 0.0]])
    behav = torch.tensor([[0.0, -0.5, -2.0]])  # sampled by an older policy: ratios 1, 1.65, 7.4
    assert torch.equal(no_correction(old, behav, 2.0), torch.ones(1, 3))

    def loss_and_grad(algo):
        logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
        inputs = LossInputs(logp, logp.detach(), torch.tensor([1.0]), torch.ones(1, 3), behavior_logp=behav)
        loss, metrics = policy_loss(inputs, algo)
        loss.backward()
        return loss.item(), logp.grad, metrics

    loss_none, grad_none, m_none = loss_and_grad(AlgoConfig(behavior_correction="none"))
    loss_off, grad_off, _ = loss_and_grad(AlgoConfig(tis_cap=None))
    loss_tis, grad_tis, _ = loss_and_grad(AlgoConfig())
    assert loss_none == loss_off == pytest.approx(-1.0)  # ratio 1 on each token, advantage 1
    assert torch.equal(grad_none, grad_off)
    assert m_none["tis_weight_mean"] == 1.0
    assert not torch.allclose(grad_none, grad_tis)  # TIS reweights the stale tokens
    assert AlgoConfig(behavior_correction="none").problems() == []


def test_an_engine_replaced_mid_run_counts_from_zero_in_the_busy_fraction():
    """The engine's counters are running totals; a process that replaced a dead one starts them from zero.
    Subtracting the dead one's totals gave a negative wall time and a NaN busy fraction (seen in an e2e run)."""
    f = feeder(version=1)
    f.pool.pids = [11]

    def poll(pid, busy, wall, tokens):
        f._account(0, {"pid": pid, "stats": {"busy_s": busy, "wall_s": wall, "tokens": tokens, "pause_s": 0.0}})

    poll(11, 8.0, 10.0, 100)
    assert f._engine_since_last()["pipeline/engine_busy_frac"] == pytest.approx(0.8)
    poll(12, 1.5, 2.0, 20)  # Ray started a new process: its totals count from zero
    m = f._engine_since_last()
    assert m["pipeline/engine_busy_frac"] == pytest.approx(0.75) and m["pipeline/engine_tokens_per_s"] == pytest.approx(10)
    poll(12, 3.5, 4.0, 40)  # the same process again: only what it did since
    assert f._engine_since_last()["pipeline/engine_busy_frac"] == pytest.approx(1.0)


def test_the_final_checkpoint_records_what_was_in_flight_when_the_engines_stopped_and_a_resume_says_it(tmp_path,
                                                                                                    capsys):
    """The last checkpoint is taken after the engines stopped (the final evaluation needs them idle): it
    records the prompts the feeder had in flight then; a resume from it says how many it generates again
    and its stream hands them out first."""
    t, checkpoint = checkpointing_trainer(tmp_path, [[1, 0]] * 8, mode="pipeline")
    examples = t.stream.examples
    t.stream, t.step = PromptStream(examples, seed=0), 3
    stopped = []
    t.schedule.feeder = SimpleNamespace(stop=lambda wait_s=None: stopped.append(True),
                                        checkpoint_state=lambda: {"epoch": 0, "index": 6, "in_flight": [4, 2]})
    t.schedule.stop(recorded=True)
    assert stopped and t.schedule.feeder is None
    said = capsys.readouterr().out
    assert "pipeline: 2 group(s) in flight when the engines stopped were not trained on (a checkpoint records" in said
    path = t.save_checkpoint(finished=True)
    assert checkpoint.load_driver_state(path)["data"] == {"epoch": 0, "index": 6, "in_flight": [4, 2]}
    assert "records the prompts of the 2 group(s) in flight" in capsys.readouterr().out

    r, _ = checkpointing_trainer(tmp_path, [[1, 0]] * 8, mode="pipeline")
    r.stream = PromptStream(examples, seed=0)
    r.resume_from = resume_point(r.cfg)
    r._resume()
    assert r.step == 3 and r.regenerated_on_resume == 2  # the first step's pipeline/regenerated_on_resume
    assert "the 2 group(s) in flight at that checkpoint are generated again first" in capsys.readouterr().out
    assert r.stream.take(2) == [examples[4], examples[2]]


def submitting(f: PipelineFeeder, died: set[int] = frozenset()) -> list[int]:
    """Fakes the engines' calls: each call is recorded by engine; an engine in `died` fails as a dead actor."""
    called = []

    def call(w, make_call, what):
        called.append(w)
        if w in died:
            with f._cv:
                f._failed.add(w)
                f._revive = True
            return None
        return {"pid": 1}

    f._call = call
    return called


def test_an_engine_lost_with_its_host_leaves_the_fleet_and_its_groups_go_to_the_others(capsys):
    """Two engines, 4 groups in flight each (the bound, 8, shared): engine 1's host is lost, and a call
    to it fails. The feeder calls it no more, and the loop's thread takes it out of the fleet (no revive:
    its host is gone); its 4 groups are generated again on engine 0, which now takes the whole bound."""
    examples = [Example(f"p{i}", prompt_ids=[1, i]) for i in range(40)]
    pool = FakePool(engines=2)
    f = feeder(version=0, stream=PromptStream(examples, seed=0), pool=pool, pipeline_groups_in_flight=8)
    called = submitting(f)
    f._top_up()
    assert called == [0, 1] and [len(h) for h in f._held] == [4, 4]
    on_1 = [ex for ex, _ in f._held[1].values()]

    pool.lost.add(1)
    called = submitting(f, died={1})
    f._poll = lambda: [f._call(w, None, "returning finished groups") for w in f._supplied()]
    f._poll()
    assert f._failed == {1} and f._revive
    called.clear()
    f._top_up()
    f._poll()
    assert called == [0]  # left alone from its first failed call (engine 0 is full: polled only)

    f._check_fleet()  # what next_batch does first
    assert pool.live == [0] and ("leave", 1) in pool.events and ("revive", 1) not in pool.events
    assert f._held[1] == {} and list(f._again) == on_1 and f.requeued == 4 and f._failed == set() and not f._revive
    assert "rollout worker 1 left the fleet; its 4 group(s) in flight are generated on the others" in capsys.readouterr().out
    called.clear()
    f._top_up()
    assert called == [0] and len(f._held[0]) == 8 and not f._again  # engine 0 takes the lost groups first
    assert on_1 == [ex for ex, _ in f._held[0].values()][4:]


def test_an_engine_that_joins_is_fed_only_once_it_has_the_weights():
    """An elastic start with 1 of 2 engines: the other is placed when a node joins. The pool puts it in its
    live list before it sends it the weights (on_rejoin); the feeder gives it groups only after that."""
    pool = FakePool(engines=2, live=[0])
    examples = [Example(f"p{i}", prompt_ids=[1, i]) for i in range(40)]
    f = feeder(version=2, stream=PromptStream(examples, seed=0), pool=pool, pipeline_groups_in_flight=8)
    called = submitting(f)
    f._top_up()
    assert called == [0] and len(f._held[0]) == 8  # one engine: the whole bound
    fed_while_syncing = []
    pool.on_rejoin = lambda w: fed_while_syncing.append(f._supplied())
    pool.joining.add(1)
    f._check_fleet()
    assert pool.events[-1] == ("rejoin", 1) and fed_while_syncing == [[0]]
    assert f._supplied() == [0, 1]
    f._held[0].clear()  # engine 0 finished its groups
    called.clear()
    f._top_up()
    assert called == [0, 1] and [len(h) for h in f._held] == [4, 4]  # the bound shared again


def test_a_killed_engine_whose_host_lives_is_revived_and_fed_again():
    """A call found engine 0 dead while its host lives: the loop's thread has the pool revive it (Ray restarts
    it in place, the pool re-syncs it) and it is fed again; then every engine is asked whether it changed."""
    pool = FakePool(engines=2)
    f = feeder(version=0, pool=pool)
    submitting(f, died={0})
    f._call(0, None, "taking prompts")
    assert f._supplied() == [1]
    f._check_fleet()
    assert ("revive", 0) in pool.events and ("recover_all", (0, 1)) in pool.events and pool.live == [0, 1]
    assert pool.events.index(("revive", 0)) < pool.events.index(("recover_all", (0, 1)))
    assert f._supplied() == [0, 1]


def test_an_engine_found_dead_while_the_others_are_asked_is_recovered_not_raised():
    """While the loop's thread asks the live engines whether they changed process, one that died meanwhile
    (its host lost before any call of the feeder failed) is recovered like one a call found dead: out of the
    fleet with its host, its groups generated again, the run going on."""
    pool = FakePool(engines=2)
    f = feeder(version=0, pool=pool)
    pool.dying.add(1)
    f._revive = True  # engine 0 answered as another process
    f._check_fleet()
    assert pool.live == [0] and ("leave", 1) in pool.events and f._supplied() == [0]


class TakeGuard:
    """A PromptStream that records how many prompts each take asks for, and refuses a take no bound would allow
    (with max_staleness 10^9 the feeder asked for 2 x 10^9 and grew the driver's memory 25 MB/s: issue 59)."""

    def __init__(self):
        self.stream, self.asked = PromptStream([Example(f"p{i}", prompt_ids=[1, i]) for i in range(50)], seed=0), []

    def take(self, n):
        self.asked.append(n)
        if n > 10_000:
            raise MemoryError(f"asked for {n} prompts")
        return self.stream.take(n)

    def state(self, **kw):
        return self.stream.state(**kw)


def engines_that_never_finish(f: PipelineFeeder) -> None:
    """Every engine takes what it is given and hands nothing back."""
    idle = {"pid": 1, "rollouts": [], "stats": {"busy_s": 0.0, "wall_s": 0.0, "tokens": 0, "pause_s": 0.0}}
    f._call = lambda w, call, what: {"pid": 1} if what == "taking prompts" else idle
    f.pool.pids = [1] * len(f.pool.handles)
    for h in f.pool.handles:
        h.pipeline_take = h.pipeline_stop = SimpleNamespace(remote=lambda: None)


def test_a_huge_max_staleness_keeps_few_groups_in_flight_and_sigterm_stops_within_the_grace(monkeypatch):
    """Issue 59, item 1: trainer.mode=pipeline with max_staleness=1000000000 showed nothing for 150 s, the driver
    grew to 7 GB, and a SIGTERM was not honoured within trainer.stop_grace_s. Now the default bound is at most
    PIPELINE_STEPS_AHEAD steps of prompts, and a SIGTERM while the loop waits for groups stops it within the grace."""
    stream = TakeGuard()
    f = feeder(version=0, stream=stream, max_staleness=10**9)
    engines_that_never_finish(f)
    monkeypatch.setattr("cluster.driver.pipeline.wait_for", lambda *a, **k: None)  # the engines' pipeline_stop
    signals = StopSignals(grace_s=1.0)
    signals.install()
    signals.armed = True
    sigterm = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    sigterm.start()
    t0 = time.monotonic()
    try:
        for th in f._threads:
            th.start()
        with pytest.raises(Interrupted):
            f.next_batch(timeout_s=30)
        f.stop(signals.grace_left())
    finally:
        sigterm.cancel()  # a test that failed before the signal must not send it to the test runner
        signals.restore()
    assert time.monotonic() - t0 < 0.3 + 1.0 + 2.0  # the signal, the grace, a wait of the loop's
    assert 0 < max(stream.asked) and sum(stream.asked) <= RunConfig().trainer.PIPELINE_STEPS_AHEAD * 2
    assert sum(map(len, f._held)) == sum(stream.asked)


def test_a_wait_for_groups_says_what_it_waits_for_and_names_the_silent_engine(monkeypatch, capsys):
    """Issue 59, items 1 and 4: "pipeline: 0 of 4 groups in 60s" named no engine while one was hung. Now a waiting
    line comes every WAITING_LINE_S and the timeout names each engine's groups, the one silent longest first."""
    monkeypatch.setattr("cluster.driver.pipeline.WAITING_LINE_S", 0.0)
    f = feeder(version=0, pool=FakePool(engines=2))
    now = time.monotonic()
    f._held[0] = {0: (Example("a"), 1)}
    f._held[1] = {1: (Example("b"), 1), 2: (Example("c"), 1)}
    f._last_back = [now - 2, now - 95]
    with pytest.raises(TimeoutError) as e:
        f.next_batch(timeout_s=0.5)
    assert re.search(r"rollout worker 1 has answered nothing for the longest \(9[5-7]s\)", str(e.value))
    assert re.search(r"rollout worker 0: 1 group\(s\) in flight, none back for [2-4]s", str(e.value))
    line = capsys.readouterr().out
    assert "pipeline: waiting for groups, 0 of 2 after 0s (at most 0s, trainer.actor_timeout_s)" in line
    assert "rollout worker 1 has answered nothing for the longest" in line


def test_engines_stopped_by_a_failure_claim_no_checkpoint_of_their_prompts(tmp_path, capsys):
    """Issue 59, item 5: after a failure the console said "a checkpoint records their prompts: a run resumed from it
    generates them again first", and no checkpoint existed. Stopped on the way out of a failure, it claims none."""
    t, _ = checkpointing_trainer(tmp_path, [[1, 0]] * 8, mode="pipeline")
    t.schedule.feeder = SimpleNamespace(stop=lambda wait_s=None: None,
                                        checkpoint_state=lambda: {"epoch": 0, "index": 6, "in_flight": [4, 2]})
    t.schedule.stop()
    said = capsys.readouterr().out
    assert "2 group(s) in flight when the engines stopped were not trained on and no checkpoint records them" in said
    assert "a checkpoint records" not in said


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_pipeline_groups_in_flight_outside_pipeline_mode_is_refused_not_ignored(mode):
    """Issue 59, item 9: trainer.pipeline_groups_in_flight was ignored in async mode without a word."""
    cfg = RunConfig()
    cfg.trainer.mode, cfg.trainer.pipeline_groups_in_flight = mode, 8
    assert any(f"trainer.pipeline_groups_in_flight=8 is read only by trainer.mode=pipeline, and trainer.mode is {mode}"
               in p for p in cfg.problems()), cfg.problems()
    cfg.trainer.mode = "pipeline"
    assert not any("pipeline_groups_in_flight" in p for p in cfg.problems())


def test_an_engine_that_answers_nothing_leaves_the_fleet_and_its_groups_go_to_the_others(capsys, monkeypatch):
    """Issue 59, items 3 and 4: one hung engine stopped pipeline mode ("pipeline: 0 of 4 groups in 60s", while engine 0
    was healthy). A call to it that times out has the pool take it out of the fleet, down to rollout.min_workers."""
    examples = [Example(f"p{i}", prompt_ids=[1, i]) for i in range(12)]
    pool = FakePool(engines=2)
    f = feeder(version=0, stream=PromptStream(examples, seed=0), pool=pool, pipeline_groups_in_flight=4)
    f._call = lambda w, call, what: {"pid": 1}
    f._top_up()
    assert len(f._held[1]) == 2
    silent = ActorFailed("rollout worker 1", "returning finished groups", died=False, detail="no answer within 600s")

    def wait_for(ref, actor, what, timeout_s, probe=None):
        raise silent

    del f._call  # the feeder's own from here: its wait on engine 1 times out
    monkeypatch.setattr("cluster.driver.pipeline.wait_for", wait_for)
    assert f._call(1, lambda: None, "returning finished groups") is None
    f._check_fleet()
    assert pool.live == [0] and ("leave", 1) in pool.events and not f._held[1] and len(f._again) == 2
    assert "rollout worker 1 left the fleet; its 2 group(s) in flight are generated on the others" in \
        capsys.readouterr().out
