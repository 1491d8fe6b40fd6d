"""Collecting a batch: the counters, dynamic-sampling refill and the trim to the learner's rank count.

The driver's neighbours (the rollout pool, the prompt stream, the reward scorer) are faked; the
collecting logic is the real `Trainer._collect`."""
import math
import threading
from types import SimpleNamespace

import pytest

from actors.rewards import RewardResult
from actors.rollout import Completion, PromptRollout
from cluster.collect import Batch, CollectStats, ScoredGroup, trim_to_ranks
from cluster.config import RunConfig
from cluster.data import Example
from cluster.metrics import MULTITURN_KEYS, STEP_KEYS
from cluster.trainer import Trainer
from cluster.workers import Stopwatch

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

    def __init__(self, skip=()):
        self.skip, self.calls = set(skip), []

    def generate(self, prompts, group_size, seeds, greedy=False, expected_version=None):
        self.calls.append(len(prompts))
        skipped = [f"p{ids[0]}" in self.skip for ids in prompts]
        return [PromptRollout(p, [1, 2], [] if skip else
                              [Completion([3] * (i + 1), [-0.5] * (i + 1), f"c{i}", "stop") for i in range(group_size)],
                              weight_version=expected_version, skipped="too long" if skip else None)
                for p, skip in zip(prompts, skipped)]


class FakeScorer:
    def score(self, prompts, completions, fields, max_new_tokens=None):
        rewards = [f["rewards"][i % G] for i, f in enumerate(fields)]
        return RewardResult(rewards=[0.0 if math.isnan(r) else r for r in rewards],
                            errors=sum(math.isnan(r) for r in rewards),
                            error_samples=["boom"] if any(math.isnan(r) for r in rewards) else [],
                            seconds=0.0, per_function={"f": rewards})


def trainer(rewards_per_prompt, *, want=3, dynamic=False, extra=16, ranks=1, skip=()):
    cfg = RunConfig()
    cfg.trainer.group_size, cfg.trainer.prompts_per_step = G, want
    cfg.trainer.dynamic_sampling, cfg.trainer.max_extra_prompts = dynamic, extra
    cfg.learner.num_ranks = ranks
    t = Trainer.__new__(Trainer)  # no Ray, no data files: only what collecting touches
    t.cfg, t.run_dir, t.version, t.engine_version, t.step = cfg, "/tmp/run", 5, 5, 0
    t.stream, t.pool, t.scorer = FakeStream(rewards_per_prompt), FakePool(skip), FakeScorer()
    t._engines_lock = threading.RLock()
    t.actors = SimpleNamespace(reference=None)
    t.lend = {}
    return t


def test_without_dynamic_sampling_every_group_is_kept_and_counted():
    t = trainer([[1, 0], [1, 1], [0, 1]])
    b = t._collect(step=0)
    assert [e.prompt for e in b.examples] == ["p0", "p1", "p2"] and b.rewards == [1, 0, 1, 1, 0, 1]
    assert b.prompt_ids == [[1, 2]] * 6 and b.completion_ids[:2] == [[3], [3, 3]] and b.weight_version == 5
    assert b.stream_state == {"pos": 0} and t.pool.calls == [3]
    s = b.stats
    assert (s.groups, s.zero_var_groups, s.extra_prompts, s.gen_tokens) == (3, 1, 0, 9)


def test_reference_actor_scores_the_kept_completions_while_collecting(monkeypatch):
    """With a reference actor, its log-probs are part of the collected batch (in the async schedule
    they are then computed while the learner trains), for exactly the rows the learner gets."""
    import cluster.trainer as trainer_module

    calls = []

    class FakeReference:
        class logprobs:  # noqa: N801 - stands in for an actor method (.remote)
            @staticmethod
            def remote(prompt_ids, completion_ids):
                calls.append(len(completion_ids))
                return [[-0.5] * len(c) for c in completion_ids]

    monkeypatch.setattr(trainer_module.launch, "wait_for", lambda refs, *what: refs)
    t = trainer([[1, 0], [1, 1], [0, 1], [0, 0]], dynamic=True)
    t.actors = SimpleNamespace(reference=FakeReference())
    b = t._collect(step=0)
    assert [e.prompt for e in b.examples] == ["p0", "p2"]
    assert calls == [len(b.completion_ids)] == [2 * G]  # one call, after the flat groups were dropped
    assert b.ref_logp == [[-0.5] * len(c) for c in b.completion_ids] and b.stats.ref_s >= 0.0
    assert trainer([[1, 0]], want=1)._collect(step=0).ref_logp is None  # no reference actor, none


def test_dynamic_sampling_drops_flat_groups_and_refills_within_the_budget():
    # p1, p2 flat; the refill takes 2 prompts (p3 flat, p4 good), then 1 more (p5 good)
    t = trainer([[1, 0], [1, 1], [0, 0], [1, 1], [0, 1], [1, 0], [0, 1]], dynamic=True)
    b = t._collect(step=0)
    assert [e.prompt for e in b.examples] == ["p0", "p4", "p5"] and t.pool.calls == [3, 2, 1]
    assert (b.stats.extra_prompts, b.stats.zero_var_groups, len(b.stats.rewards)) == (3, 3, 12)
    # the cap: with 1 extra prompt allowed, one refill round of one prompt, then stop short
    t = trainer([[1, 0], [1, 1], [0, 0], [1, 1], [0, 1]], dynamic=True, extra=1)
    b = t._collect(step=0)
    assert [e.prompt for e in b.examples] == ["p0"] and t.pool.calls == [3, 1] and b.stats.extra_prompts == 1


def test_skipped_prompts_are_counted_and_the_batch_is_trimmed_to_the_ranks():
    t = trainer([[1, 0], [0, 1], [1, 0]], ranks=4, skip={"p1"})
    b = t._collect(step=0)
    assert b.stats.skipped_prompts == 1 and [e.prompt for e in b.examples] == ["p0", "p2"]  # 4 sequences
    t = trainer([[1, 0], [0, 1], [1, 0]], ranks=4)
    assert [e.prompt for e in t._collect(step=0).examples] == ["p0", "p2"][:1] + ["p1"]  # 6 -> 4 sequences


def test_every_reward_call_failing_stops_the_run_with_the_errors():
    nan = float("nan")
    with pytest.raises(RuntimeError, match="every reward call failed at step 1 .*boom"):
        trainer([[nan, nan], [nan, nan]], want=2)._collect(step=0)
    b = trainer([[nan, nan], [1, 0]], want=2)._collect(step=0)  # one failed group of two: go on
    assert b.stats.failed_groups == 1 and b.stats.reward_errors == 2


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
     "seconds": 0.1, "sync": {"bytes": 10}, "train_threads_max": 1},
    {"skipped": True},  # nothing to train on
])
def test_step_metrics_are_exactly_the_declared_keys(learner_metrics):
    t = trainer([[1, 0], [0, 1], [1, 0]])
    b = t._collect(step=0)
    sw = Stopwatch()
    sw.t.update(train_s=1.0, step_s=2.0)
    row = t._step_metrics(b, learner_metrics, sw)
    assert set(row) <= set(STEP_KEYS)
    if "skipped" not in learner_metrics:
        # single-turn: the multi-turn keys are left to the logger (NaN)
        assert set(row) == set(STEP_KEYS) - set(MULTITURN_KEYS) and row["sync_bytes"] == 10
    else:
        assert row["update_skipped"] is True and "kl" not in row  # the logger writes it as NaN


def test_a_collected_batch_lends_its_cores_to_the_step_in_training():
    """Async on CPU: once batch k+1 is collected, the ranks training step k may take the idle cores."""
    t = trainer([[1, 0], [0, 1], [1, 0]])
    offers = []
    t.learners = SimpleNamespace(lend_threads=lambda step, threads: offers.append((step, threads)))
    t._collect(step=4, lend_to=3)
    assert offers == []  # nothing to lend (sync schedule, GPU, or learner.threads set)
    t.lend = {0: 2}
    t._collect(step=4)
    assert offers == []  # no training overlaps this collection (the first batch, a regeneration)
    t._collect(step=4, lend_to=3)
    assert offers == [(3, {0: 2})]


def test_batch_from_no_groups_carries_the_current_version():
    b = Batch.from_groups([], {"pos": 3}, CollectStats(), version_if_empty=7)
    assert b.examples == [] and b.weight_version == 7 and b.stream_state == {"pos": 3}
