"""Collecting a batch: the counters, dynamic-sampling refill and the trim to the learner's rank count.

The driver's neighbours (the rollout pool, the prompt stream, the reward scorer) are faked; the
collecting logic is the real `Collector.collect`, in a `Trainer` where the loop's side is tested."""
import dataclasses
import math
import threading
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import cluster.driver.reference as reference
from actors.completions import Completion, PromptRollout
from actors.multiturn.trajectories import MultiTurnRollout, Trajectory
from actors.rewards.base import FunctionStats
from actors.rewards.scorer import REWARD_STATS, RewardResult
from cluster.config import RunConfig
from cluster.data.dataset import Example
from cluster.driver.batch import Batch, CollectStats, EnvironmentNotes, ScoredGroup, load_batch, save_batch, trim_to_ranks
from cluster.driver.collector import Collector
from cluster.driver.comebacks import Comebacks
from cluster.driver.context import RunContext
from cluster.driver.engine_weights import EngineWeights, WeightVersions
from cluster.driver.schedules import SCHEDULES
from cluster.driver.step_row import step_row
from cluster.driver.trainer import Trainer
from cluster.driver.worker_groups import RolloutPool, Stopwatch
from cluster.run.metrics import COMPLETION_KEYS, MULTITURN_KEYS, PIPELINE_KEYS, STEP_KEYS, MetricsLogger
from cluster.run.resume import resume_point
from learner import checkpoint
from learner.grpo import ADVANTAGE_ESTIMATORS, group_advantages

G = 2


class FakeStream:
    """Prompts whose `rewards` field says what the fake scorer gives each of its G completions."""

    def __init__(self, rewards_per_prompt):
        # the driver sends each example's rendered token ids: here [i] for prompt "p{i}"
        self.examples = [Example(f"p{i}", {"rewards": r}, prompt_ids=[i]) for i, r in enumerate(rewards_per_prompt)]
        self.pos = 0

    def state(self):
        return {"pos": self.pos}

    def take(self, n):
        out = self.examples[self.pos:self.pos + n]
        self.pos += n
        return out


class FakePool:
    restarts = 0
    live = [0]
    handles = [None]  # one engine (the pipeline's feeder is made over it, never started here)
    fleet_changed = False

    def __init__(self, skip=()):
        self.skip, self.calls, self.activities = set(skip), [], []

    def generate(self, prompts, group_size, seeds, greedy=False, expected_version=None, activity=None):
        self.calls.append(len(prompts))
        self.activities.append(activity)
        skipped = [f"p{ids[0]}" in self.skip for ids in prompts]
        return [PromptRollout(p, [1, 2], [] if skip else
                              [Completion([3] * (i + 1), [-0.5] * (i + 1), f"c{i}", "stop") for i in range(group_size)],
                              weight_version=expected_version, skipped="too long" if skip else None)
                for p, skip in zip(prompts, skipped)]


class FakeScorer:
    """Rewards from the examples' `rewards` field: a number, NaN (a failed call), "timeout" (a call that
    timed out) or None (a null)."""

    names = {"f": "f"}  # spec -> its one name

    def score(self, prompts, completions, fields, max_new_tokens=None, group_size=None):
        raw = [f["rewards"][i % G] for i, f in enumerate(fields)]
        failed = [r == "timeout" or (isinstance(r, float) and math.isnan(r)) for r in raw]
        values = [v for v, bad in zip(raw, failed) if v is not None and not bad]
        return RewardResult(rewards=[0.0 if bad else math.nan if r is None else r for r, bad in zip(raw, failed)],
                            errors=sum(failed), error_samples=["boom"] if any(failed) else [],
                            seconds=0.0, per_function={"f": raw}, failed=failed, unscorable=raw.count(None),
                            functions={"f": FunctionStats(values, errors=sum(failed), unscorable=raw.count(None),
                                                          calls=len(raw), timeouts=raw.count("timeout"), seconds=0.5,
                                                          first_error="boom" if any(failed) else None)})

    def judge(self, prompts, completions, fields):
        return [c.text == "c0" for c in completions]  # the first sample of every prompt is right

    def timeout_setting(self, name):
        return "reward.timeout_s=3"

    def restarted_actors(self):
        return []  # no reward-model actors here


def fake_context(cfg, stream, pool, scorer, *, learners=None, versions=None, run_dir="/tmp/run") -> RunContext:
    """The run's context over fakes of the pool, the stream, the scorer (and `learners`): no Ray, no actors."""
    versions = versions or WeightVersions(learner=5, sent=5)
    weights = EngineWeights(cfg, versions, "gloo", pool, learners, {}, hosts=None, lock=threading.RLock())
    comebacks = Comebacks(actors=None, placement=None, hosts=None, threads={}, weights=weights, scorer=scorer, pool=pool,
                          timeout_s=5.0)  # the loop asks it each step: no reward model came back here
    return RunContext(cfg, run_dir, stream, scorer, eos_id=9, env_notes=EnvironmentNotes(cfg.rollout.max_model_len),
                      actors=SimpleNamespace(reference=None, learners=[]), placement=None, hosts=None, threads={}, lend={},
                      learner_params=None, learners=learners, pool=pool, versions=versions, weights=weights,
                      comebacks=comebacks, restarts=None, reference=None)


def trainer(rewards_per_prompt, *, want=3, dynamic=False, extra=16, ranks=1, skip=(), learners=None, mode="sync"):
    cfg = RunConfig()
    cfg.trainer.group_size, cfg.trainer.prompts_per_step = G, want
    cfg.trainer.dynamic_sampling, cfg.trainer.max_extra_prompts = dynamic, extra
    cfg.trainer.mode, cfg.learner.num_ranks = mode, ranks
    t = Trainer.__new__(Trainer)  # no Ray, no data files: only what collecting and the loop's side touch
    t.cfg, t.run_dir, t.step = cfg, "/tmp/run", 0
    t.stream, t.scorer = FakeStream(rewards_per_prompt), FakeScorer()
    t.ctx = fake_context(cfg, t.stream, FakePool(skip), t.scorer, learners=learners)
    t.versions, t.pool = t.ctx.versions, t.ctx.pool  # t.pool: the fake, for the tests' asserts
    t.collector = Collector(t.ctx)
    t.schedule = SCHEDULES[mode](t.ctx, t.collector)
    return t


def test_without_dynamic_sampling_every_group_is_kept_and_counted():
    t = trainer([[1, 0], [1, 1], [0, 1]])
    b = t.collector.collect(step=0)
    assert [e.prompt for e in b.examples] == ["p0", "p1", "p2"] and b.rewards == [1, 0, 1, 1, 0, 1]
    assert b.prompt_ids == [[1, 2]] * 6 and b.completion_ids[:2] == [[3], [3, 3]] and b.weight_version == 5
    assert b.stream_state == {"pos": 0} and t.pool.calls == [3]
    s = b.stats
    assert (s.groups, s.zero_var_groups, s.extra_prompts, s.gen_tokens) == (3, 1, 0, 9)


def test_reference_actor_scores_the_kept_completions_while_collecting(monkeypatch):
    """With a reference actor, its log-probs are part of the collected batch (in the async schedule
    they are then computed while the learner trains), for exactly the rows the learner gets."""
    calls = []

    class FakeReference:
        class logprobs:  # noqa: N801 - stands in for an actor method (.remote)
            @staticmethod
            def remote(prompt_ids, completion_ids):
                calls.append(len(completion_ids))
                return {"logprobs": [[-0.5] * len(c) for c in completion_ids], "pid": 7}

    monkeypatch.setattr(reference, "wait_for", lambda refs, *what: refs)
    t = trainer([[1, 0], [1, 1], [0, 1], [0, 0]], dynamic=True)
    t.collector.reference = reference.ReferenceLogprobs(FakeReference(), timeout_s=5.0)
    b = t.collector.collect(step=0)
    assert [e.prompt for e in b.examples] == ["p0", "p2"]
    assert calls == [len(b.completion_ids)] == [2 * G]  # one call, after the flat groups were dropped
    assert b.ref_logp == [[-0.5] * len(c) for c in b.completion_ids] and b.stats.ref_s >= 0.0
    assert trainer([[1, 0]], want=1).collector.collect(step=0).ref_logp is None  # no reference actor, none


def test_dynamic_sampling_drops_flat_groups_and_refills_within_the_budget():
    # p1, p2 flat; the refill takes 2 prompts (p3 flat, p4 good), then 1 more (p5 good)
    t = trainer([[1, 0], [1, 1], [0, 0], [1, 1], [0, 1], [1, 0], [0, 1]], dynamic=True)
    b = t.collector.collect(step=0)
    assert [e.prompt for e in b.examples] == ["p0", "p4", "p5"] and t.pool.calls == [3, 2, 1]
    assert (b.stats.extra_prompts, b.stats.zero_var_groups, len(b.stats.rewards)) == (3, 3, 12)
    # the cap: with 1 extra prompt allowed, one refill round of one prompt, then stop short
    t = trainer([[1, 0], [1, 1], [0, 0], [1, 1], [0, 1]], dynamic=True, extra=1)
    b = t.collector.collect(step=0)
    assert [e.prompt for e in b.examples] == ["p0"] and t.pool.calls == [3, 1] and b.stats.extra_prompts == 1


def test_skipped_prompts_are_counted_and_the_batch_is_trimmed_to_the_ranks():
    t = trainer([[1, 0], [0, 1], [1, 0]], ranks=4, skip={"p1"})
    b = t.collector.collect(step=0)
    assert b.stats.skipped_prompts == 1 and [e.prompt for e in b.examples] == ["p0", "p2"]  # 4 sequences
    t = trainer([[1, 0], [0, 1], [1, 0]], ranks=4)
    assert [e.prompt for e in t.collector.collect(step=0).examples] == ["p0", "p2"][:1] + ["p1"]  # 6 -> 4 sequences


def test_no_function_scoring_any_sample_is_collected_for_the_trainer_to_log_then_halt():
    """Issue 36: collecting does not raise (the step's metrics row must be written first); the batch says
    that nothing was scored and which function failed, with its error count and first error."""
    nan = float("nan")
    b = trainer([[nan, nan], [nan, nan]], want=2).collector.collect(step=0)
    assert b.stats.every_group_failed() and b.stats.failed_functions() == ["f"]
    assert b.stats.function_errors() == {"f": "the reward function f failed every call (4 error(s)), first: boom"}
    b = trainer([[nan, nan], [1, 0]], want=2).collector.collect(step=0)  # one failed group of two: go on
    assert b.stats.failed_groups == 1 and b.stats.reward_errors == 2 and not b.stats.every_group_failed()
    assert b.stats.failed_functions() == [] and "failed some calls (2 error(s))" in b.stats.function_errors()["f"]


def test_unscorable_completions_stay_in_place_with_a_mask_of_zeros_and_are_counted():
    b = trainer([[1, None], [None, None], [0, 1]]).collector.collect(step=0)
    assert b.rewards[:1] == [1] and all(math.isnan(r) for r in b.rewards[1:4]) and b.rewards[4:] == [0, 1]
    assert b.loss_mask == [[1], [0, 0], [0], [0, 0], [1], [1, 1]]  # out of the loss, in their group's place
    s = b.stats
    assert s.reward_unscorable == 3 and s.rewards == [1, 0, 1] and s.zero_var_groups == 2  # < 2 scorable: no signal
    m = s.metrics()
    assert m["reward_unscorable"] == 3 and m["reward_mean"] == 2 / 3
    assert (m["rewards/f/unscorable"], m["rewards/f/errors"], m["rewards/f/s"]) == (3, 0, 0.5)
    assert m["rewards/f/mean"] == 2 / 3 and "rewards/f/truncated" not in m
    kept = trainer([[1, None], [None, None], [0, 1]], dynamic=True, want=3, extra=0).collector.collect(step=0)
    assert [e.prompt for e in kept.examples] == ["p2"]  # groups with fewer than 2 scorable samples carry no signal


def test_a_function_that_timed_out_on_every_call_is_named_with_its_timeout():
    b = trainer([["timeout", "timeout"], ["timeout", "timeout"]], want=2).collector.collect(step=0)
    assert b.stats.function_errors(lambda name: "reward.timeout_s=3") == {
        "f": "the reward function f failed every call (4 error(s), every call timed out (reward.timeout_s=3)), first: boom"}
    b = trainer([["timeout", 1.0], [0.0, "timeout"]], want=2).collector.collect(step=0)  # some calls finished
    assert b.stats.failed_functions() == [] and "timed out" not in b.stats.function_errors(lambda n: "x")["f"]


def test_trim_to_ranks():
    groups = [ScoredGroup(Example(str(i)), None, []) for i in range(5)]
    assert len(trim_to_ranks(groups, 2, 4)) == 4 and len(trim_to_ranks(groups, 3, 2)) == 4
    assert len(trim_to_ranks(groups, 4, 8)) == 4 and trim_to_ranks(groups[:1], 3, 2) == []


def test_collect_stats_metrics():
    s = CollectStats()
    assert math.isnan(s.metrics()["reward_mean"]) and s.metrics()["reward_std"] == 0.0 and not s.every_group_failed()
    s.add_group([1.0, 0.0], gen_tokens=7, failed=False)
    s.add_group([1.0, 1.0], gen_tokens=3, failed=True)
    m = s.metrics()
    assert m["reward_mean"] == 0.75 and math.isclose(m["reward_std"], 0.5) and m["gen_tokens"] == 10
    assert s.zero_var_groups == 1 and s.failed_groups == 1 and not s.every_group_failed()


@pytest.mark.parametrize("learner_metrics", [
    {"loss": 0.1, "pg_loss": 0.1, "kl": 0.0, "clip_frac": 0.0, "entropy": 1.0, "grad_norm": 1.0, "lr": 1e-6,
     "ratio_mean": 1.0, "tis_weight_mean": 1.0, "logprob_diff_mean": 1e-5, "logprob_diff_max": 1e-4, "tokens": 9,
     "seconds": 0.1, "sync": {"bytes": 10}, "train_threads_max": 1, "learner_peak_bytes": 1e8},
    {"skipped": True},  # nothing to train on
])
def test_step_metrics_are_exactly_the_declared_keys(learner_metrics):
    t = trainer([[1, 0], [0, 1], [1, 0]])
    b = t.collector.collect(step=0)
    sw = Stopwatch()
    sw.t.update(train_s=1.0, step_s=2.0)
    row = step_row(t.cfg, b, learner_metrics, sw, step=t.step, version=t.version, pool=t.pool, learner_params=None)
    per_function = {f"rewards/f/{stat}" for stat in REWARD_STATS}  # the run's reward function keys (metric_keys)
    assert set(row) <= set(STEP_KEYS) | per_function
    if "skipped" not in learner_metrics:
        # single-turn: the multi-turn keys are left to the logger (NaN); so are the pipeline mode's
        per_turn = {k for k in COMPLETION_KEYS if "/turn_" in k}
        assert set(row) == (set(STEP_KEYS) - set(MULTITURN_KEYS) - set(PIPELINE_KEYS) - per_turn) | per_function
        assert row["sync_bytes"] == 10 and row["staleness/token_max"] == row["staleness"] and row["versions_per_sequence_mean"] == 1
    else:
        assert row["update_skipped"] is True and "kl" not in row  # the logger writes it as NaN


def test_a_collected_batch_lends_its_cores_to_the_step_in_training():
    """Async on CPU: once batch k+1 is collected, the ranks training step k may take the idle cores."""
    t = trainer([[1, 0], [0, 1], [1, 0]])
    offers = []
    t.collector.learners = SimpleNamespace(lend_threads=lambda step, threads: offers.append((step, threads)))
    t.collector.collect(step=4, lend_to=3)
    assert offers == []  # nothing to lend (sync schedule, GPU, or learner.threads set)
    t.collector.lend = {0: 2}
    t.collector.collect(step=4)
    assert offers == []  # no training overlaps this collection (the first batch, a regeneration)
    t.collector.collect(step=4, lend_to=3)
    assert offers == [(3, {0: 2})]


def test_batch_from_no_groups_carries_the_current_version():
    b = Batch.from_groups([], {"pos": 3}, CollectStats(), version_if_empty=7, advantage_estimator="grpo")
    assert b.examples == [] and b.weight_version == 7 and b.stream_state == {"pos": 3}


def test_a_saved_batch_loads_value_for_value(tmp_path):
    """The async checkpoint's next batch: every field back, NaN environment log-probs, float32 log-probs,
    messages prompts and the counters included; an empty batch too; none saved, None."""
    t = trainer([[1, 0], [0, 1], [1, 0]])
    b = t.collector.collect(step=0)
    b.behavior_logp[0] = [float(np.float32(-0.123456789)), float("nan")]
    b.completion_ids[0] = [3, 4]
    b.loss_mask = [[1, 0]] + [[1] * len(c) for c in b.completion_ids[1:]]
    b.ref_logp = [[float(np.float32(-1 / 3))] * len(c) for c in b.completion_ids]
    b.examples[1] = Example([{"role": "user", "content": "2+2?"}], {"answer": "4", "n": 3, "odd": {1, 2}},
                            prompt_ids=[5], prompt_text="2+2?", where="data.jsonl:2")
    b.stats.reward_errors, b.stats.error_samples, b.stats.gen_s = 2, ["boom"], 0.25
    save_batch(b, tmp_path)
    got = load_batch(tmp_path)
    for name in ("prompt_ids", "completion_ids", "rewards", "advantages", "loss_mask", "ref_logp", "weight_version",
                 "stream_state"):
        assert getattr(got, name) == getattr(b, name), name
    assert got.behavior_logp[1:] == b.behavior_logp[1:] and got.behavior_logp[0][0] == b.behavior_logp[0][0]
    assert math.isnan(got.behavior_logp[0][1])
    assert got.stats == b.stats and got.stats.metrics()["reward_mean"] == b.stats.metrics()["reward_mean"]
    assert got.examples[0] == b.examples[0] and got.examples[1].prompt == b.examples[1].prompt
    assert got.examples[1].fields == {"answer": "4", "n": 3, "odd": "{1, 2}"}  # what JSON cannot hold: its str()

    empty = tmp_path / "empty"
    empty.mkdir()
    save_batch(Batch.from_groups([], {"pos": 3}, CollectStats(), version_if_empty=7, advantage_estimator="grpo"), empty)
    got = load_batch(empty)
    assert got.examples == [] and got.completion_ids == [] and got.ref_logp is None and got.weight_version == 7
    assert load_batch(tmp_path / "nothing-here") is None


def checkpointing_trainer(tmp_path, rewards_per_prompt, mode="sync"):
    """A trainer whose learners write a marker file: enough for save_checkpoint and _resume's driver side."""
    learners = SimpleNamespace(save=lambda d, tag: (Path(d) / "learner.bin").write_text("w"),
                               load=lambda d, tag: None, sync_weights=lambda v, watch=None: {})
    t = trainer(rewards_per_prompt, learners=learners, mode=mode)
    t.cfg.trainer.run_dir = str(tmp_path)
    t.ckpt_root = tmp_path / "checkpoints"
    t.log = MetricsLogger(tmp_path, 10, tensorboard=False)  # the checkpoint carries its rows
    t.cfg.checkpoint.resume = "auto"
    return t, checkpoint


def test_an_async_checkpoint_carries_the_next_batch_and_a_resume_trains_on_it(tmp_path):
    """The batch collected for step k+1 (generated with weights k-1) is saved with checkpoint k, and the
    data position is past its prompts; _resume hands that very batch to the training loop."""
    t, checkpoint = checkpointing_trainer(tmp_path, [[1, 0], [0, 1], [1, 0], [0, 1], [1, 0], [0, 1]], mode="async")
    t.step, t.schedule.position_before_pending = 2, t.stream.state()
    batch = t.collector.collect(step=2)  # what the collector thread does for the pending future
    t.schedule.pending = Future()
    t.schedule.pending.set_result(batch)
    path = t.save_checkpoint()
    assert checkpoint.load_driver_state(path)["data"] == {"pos": 3}  # after the saved batch's prompts

    r, _ = checkpointing_trainer(tmp_path, [[1, 0]] * 6)
    r.stream.load_state = lambda state: setattr(r.stream, "pos", state["pos"])
    r.resume_from = resume_point(r.cfg)
    r._resume()
    assert r.step == 2 and r.stream.pos == 3
    assert r.resumed_batch.completion_ids == batch.completion_ids and r.resumed_batch.rewards == batch.rewards

    # resumed with another group size: the batch does not fit, so it is collected anew from its prompts
    r, _ = checkpointing_trainer(tmp_path, [[1, 0]] * 6)
    r.stream.load_state = lambda state: setattr(r.stream, "pos", state["pos"])
    r.cfg.trainer.group_size = 4
    r.resume_from = resume_point(r.cfg)
    r._resume()
    assert r.resumed_batch is None and r.stream.pos == 0


def test_a_batch_saved_before_batches_carried_advantages_gets_them_at_resume(tmp_path):
    """An async checkpoint written by an older version has no advantages in next_batch.safetensors:
    it still loads, and the resume computes them as that version's loop did."""
    t, checkpoint = checkpointing_trainer(tmp_path, [[1, 0], [0, 1], [1, 0], [0, 1], [1, 0], [0, 1]], mode="async")
    t.step, t.schedule.position_before_pending = 2, t.stream.state()
    batch = t.collector.collect(step=2)
    t.schedule.pending = Future()
    t.schedule.pending.set_result(dataclasses.replace(batch, advantages=None))  # saved as that version saved it
    path = t.save_checkpoint()
    assert "advantages" not in load_file(str(Path(path) / "next_batch.safetensors"))
    assert load_batch(path).advantages is None

    r, _ = checkpointing_trainer(tmp_path, [[1, 0]] * 6)
    r.stream.load_state = lambda state: setattr(r.stream, "pos", state["pos"])
    r.resume_from = resume_point(r.cfg)
    r._resume()
    assert r.resumed_batch.advantages == batch.advantages and len(batch.advantages) == 3 * G


def test_a_failed_next_batch_still_saves_the_checkpoint_before_it(tmp_path, capsys):
    """Nothing done is lost: if the batch being collected fails, checkpoint k is saved without it, at
    the data position before its prompts, and says so."""
    t, checkpoint = checkpointing_trainer(tmp_path, [[1, 0]] * 6, mode="async")
    t.step, t.schedule.position_before_pending = 2, {"pos": 0}
    t.stream.take(3)  # the failed collection had taken its prompts
    t.schedule.pending = Future()
    t.schedule.pending.set_exception(RuntimeError("every reward call failed"))
    path = t.save_checkpoint()
    assert checkpoint.load_driver_state(path)["data"] == {"pos": 0} and load_batch(path) is None
    assert "every reward call failed" in capsys.readouterr().out


def test_completion_lengths_and_clipped_ratio_single_and_multi_turn():
    s = CollectStats()
    s.add_lengths(PromptRollout([1], [1], [Completion([3] * 4, [-0.1] * 4, "a", "length"),
                                           Completion([3, 9], [-0.1] * 2, "b", "stop")], 0), eos_id=9)
    m = s.metrics()
    assert (m["completions/mean_length"], m["completions/min_length"], m["completions/max_length"],
            m["completions/clipped_ratio"]) == (3.0, 2, 4, 0.5)
    assert "completions/turn_mean_length" not in m  # single-turn: the logger writes NaN
    # a trajectory: turn 1 ends with EOS (9), two environment tokens, turn 2 cut at max_new_tokens
    cut = Trajectory(prompt_ids=[1], token_ids=[5, 6, 9, 7, 7, 8], loss_mask=[1, 1, 1, 0, 0, 1], turn_ended=False)
    done = Trajectory(prompt_ids=[1], token_ids=[5, 9], loss_mask=[1, 1])
    s = CollectStats()
    s.add_lengths(MultiTurnRollout([cut, done], 0), eos_id=9)
    m = s.metrics()
    assert (m["completions/mean_length"], m["completions/clipped_ratio"]) == (3.0, 0.5)  # 4 and 2 model tokens
    assert (m["completions/turn_mean_length"], m["completions/turn_min_length"], m["completions/turn_max_length"],
            m["completions/turn_clipped_ratio"]) == (2.0, 1, 3, 1 / 3)


def test_a_few_completions_per_step_are_kept_with_their_scores_and_advantages():
    t = trainer([[1, 0], [1, 1], [0, 1]])
    t.cfg.metrics.completions_per_step = 4
    rows = t.collector.collect(step=0).stats.samples
    assert [(r["prompt"], r["sample"], r["reward"]) for r in rows] == [("p0", 0, 1), ("p1", 0, 1), ("p2", 0, 0),
                                                                       ("p0", 1, 0)]
    assert rows[0]["rewards"] == {"f": 1} and rows[0]["advantage"] > 0 > rows[3]["advantage"]
    assert rows[1]["advantage"] == 0.0 and rows[0]["completion"] == "c0" and rows[0]["num_tokens"] == 1
    t = trainer([[1, 0], [1, 1], [0, 1]])
    t.cfg.metrics.log_completions = False
    assert t.collector.collect(step=0).stats.samples == []


@pytest.mark.parametrize("estimator", sorted(ADVANTAGE_ESTIMATORS))
def test_the_logged_samples_carry_the_advantages_the_batch_trains_them_with(estimator):
    """Issue 60 item 4, one home per quantity: the advantage a completions.jsonl row shows is the batch's, bit for
    bit. Before, each round computed its own for the rows it logged, and a one-prompt refill round's lone group
    gets another last bit than the same group in the batch (asserted below, so this data tells them apart)."""
    t = trainer([[0.04, 0.965], [1, 1], [0.602, 0.147], [0.259, 0.234]], dynamic=True, want=3)
    t.cfg.algo.advantage_estimator, t.cfg.metrics.completions_per_step = estimator, 8
    b = t.collector.collect(step=0)
    assert t.pool.calls == [3, 1] and [e.prompt for e in b.examples] == ["p0", "p2", "p3"]  # p1 flat, p3 a refill
    rows = b.stats.samples
    at = {e.prompt: g for g, e in enumerate(b.examples)}
    assert {r["prompt"] for r in rows} == {"p0", "p1", "p2", "p3"}
    for r in rows:
        if r["prompt"] in at:
            assert r["advantage"].hex() == b.advantages[at[r["prompt"]] * G + r["sample"]].hex()
        else:
            assert r["advantage"] == 0.0  # the flat group, dropped: no signal, never trained on
    alone = group_advantages(torch.tensor([0.259, 0.234], dtype=torch.float64), G, estimator).tolist()
    if estimator == "grpo":
        assert alone != b.advantages[2 * G:3 * G]  # what the refill round alone would have logged


@pytest.mark.parametrize("estimator", sorted(ADVANTAGE_ESTIMATORS))
def test_the_learner_trains_with_the_advantages_the_batch_carries(estimator):
    """Computed once, when the batch is assembled, and bit for bit what the loop computed before it
    (one group_advantages call over the batch's rewards), with one-prompt refill rounds, whose own
    (logged) values can differ in the last bit; not pieced together from the rounds'."""
    t = trainer([[0.1, 0.7], [1, 1], [0.3, 0.2], [1, 1], [0.9, None], [0.4, 0.45], [0, 1]], dynamic=True)
    t.cfg.algo.advantage_estimator = estimator
    b = t.collector.collect(step=0)
    assert t.pool.calls == [3, 1, 1, 1] and [e.prompt for e in b.examples] == ["p0", "p2", "p5"]  # 1-prompt refills
    before = group_advantages(torch.tensor(b.rewards, dtype=torch.float64), G, estimator).tolist()
    assert [a.hex() for a in b.advantages] == [a.hex() for a in before] and len(before) == 3 * G
    trained = []
    t.ctx = dataclasses.replace(t.ctx, learners=SimpleNamespace(train=lambda batch: trained.append(batch) or {}))
    t.pad_id, t._sync_weights = 0, lambda: {}
    t._learn(b, Stopwatch())
    assert trained[0].advantages is b.advantages


@pytest.mark.parametrize("k", [0, 4])
def test_an_evaluation_is_named_in_the_waiting_lines_and_reports_its_cost(k, monkeypatch):
    """Issue 37: "waiting on rollout worker 0 (evaluating: 8 held-out prompts, ...)", not "generating";
    pass@k only with trainer.eval_pass_k > 0; eval_s in the evaluation's row."""
    t = trainer([[1, 0]] * 8)
    t.cfg.trainer.eval_pass_k = k
    held = t.stream.take(8)
    m = t.collector.evaluate(held, step=4)
    expected = ["evaluating: {} held-out prompts, greedy"] + ([f"evaluating: {{}} held-out prompts x {k} samples, pass@{k}"]
                                                              if k else [])
    assert t.pool.activities == expected and t.pool.calls == [8] * len(expected)
    assert m["accuracy"] == 1.0 and m["num_prompts"] == 8 and m["eval_s"] >= 0
    assert ("pass@4" in m) == (k == 4) and not any(key.startswith("pass@0") for key in m)

    # the pool puts the activity into its waiting lines (each engine's share of the prompts)
    said = []

    class Engine:
        class generate:  # noqa: N801 - a Ray handle's method
            @staticmethod
            def remote(prompts, group_size, seeds, greedy):
                return [PromptRollout(p, [1], [], weight_version=0) for p in prompts]

    def wait_for(ref, actor, what, timeout_s, probe=None):
        said.append(f"waiting on {actor} ({what})")
        return ref

    monkeypatch.setattr("cluster.driver.rollout_pool.wait_for", wait_for)
    pool = RolloutPool([Engine(), Engine()], 10.0, on_restart=None, pids=[1, 2])
    pool.generate([[1]] * 8, 1, list(range(8)), activity="evaluating: {} held-out prompts, greedy")
    pool.generate([[1]] * 2, 1, [0, 1])
    assert said == ["waiting on rollout worker 0 (evaluating: 4 held-out prompts, greedy)",
                    "waiting on rollout worker 1 (evaluating: 4 held-out prompts, greedy)",
                    "waiting on rollout worker 0 (generating 1 prompts)", "waiting on rollout worker 1 (generating 1 prompts)"]


def test_a_restart_before_the_first_checkpoint_expects_the_base_weights_of_the_engines(tmp_path):
    """A learner rank died before any checkpoint: every actor restarts and the run goes on from step 0. The new
    engines hold the base weights (version 0), so the driver must expect version 0 of them, not the version the
    run had reached: else every answer looks stale, is revived and re-sent for ever (seen on SmolLM2, ZeRO-3)."""
    r, _ = checkpointing_trainer(tmp_path, [[1, 0]] * 6)
    r.stream.load_state = lambda state: None
    r.resume_from = resume_point(r.cfg, restarting=True)
    assert r.resume_from.path is None  # no checkpoint yet
    r.step, r.version, r.versions.sent = 3, 3, 3  # where the run was when the rank died
    r._resume()
    assert (r.step, r.version, r.versions.sent) == (0, 0, 0)


@pytest.mark.parametrize("made_with, regenerated", [(5, False), (4, False), (3, True)])
def test_a_batch_older_than_max_staleness_is_generated_again_before_training(made_with, regenerated):
    """sync/async: the learner is at version 5, trainer.max_staleness=1: a batch of version 4 is trained on, one
    of version 3 is never (issue 58: widening this bound by one was caught by no test)."""
    t = trainer([[1, 0], [1, 1], [0, 1]])
    t.cfg.trainer.max_staleness = 1
    old = SimpleNamespace(weight_version=made_with, stream_state={})
    t.schedule.start(resumed=old, regenerated=0)  # the batch the schedule holds for the step
    fresh, _ = t.schedule.next_batch(step=0)
    assert (fresh is not old) == regenerated
    if regenerated:
        assert fresh.weight_version == 5 and t.pool.calls == [3]  # collected again, with the weights now
