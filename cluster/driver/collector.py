"""Collecting a batch (steps 1-3 of a GRPO step) and the held-out evaluation, for the driver loop.

`Collector` is the rollout side of the loop (cluster/driver/trainer.py), kept apart so the loop
there stays short, and driven by the sync and async schedules (cluster/driver/schedules/). It reads what
it uses from the run's context (cluster/driver/context.py), built once the actors are up: the config, the
prompt stream, the reward scorer, the engines (`RolloutPool`) with the lock it shares with the weight sync,
the reference actor, the learners (to lend them the cores collecting leaves idle), and the weight versions,
which the loop moves while a batch is being collected (async).
"""
from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

from cluster.data.dataset import Example
from cluster.data.render import conversation, multiturn_format
from cluster.driver.batch import (
    Batch,
    CollectStats,
    ScoredGroup,
    sample_seed,
    score_groups,
    trim_to_ranks,
)
from cluster.driver.worker_groups import Stopwatch

if TYPE_CHECKING:
    from cluster.driver.context import RunContext


class Collector:
    """The rollout side of the driver loop: generation, rewards, the reference, evaluation."""

    def __init__(self, ctx: RunContext):
        """What it reads of `ctx`: the config, the prompt stream, the scorer, the engines' pool; the reference's
        log-probs (cluster/driver/reference.py; None: no reference actor, or it runs on the learner ranks);
        ctx.lend: {learner rank: threads} it may take while collecting idles (async on CPU; empty otherwise),
        offered to ctx.learners; the engines' lock
        (ctx.weights.lock), held around each generate (the weight sync holds it around itself: an engine must
        not serve a generate between the calls of a weight update); ctx.versions: the learner's version now
        (an empty batch carries it) and the one every engine is known to hold (a lower answer means an engine
        was restarted); the EOS, which ends a multi-turn turn; the run dir, named in errors."""
        self.cfg, self.stream, self.scorer, self.pool = ctx.cfg, ctx.stream, ctx.scorer, ctx.pool
        self.reference, self.learners, self.lend, self.engines_lock = ctx.reference, ctx.learners, ctx.lend, ctx.weights.lock
        self.versions, self.eos_id, self.env_notes, self.run_dir = ctx.versions, ctx.eos_id, ctx.env_notes, ctx.run_dir

    # ------------------------------------------------------------------ collecting a batch
    def collect(self, step: int, lend_to: int | None = None) -> Batch:
        """Steps 1-3: prompts -> G completions each -> rewards, refilled and trimmed for the learner;
        then the reference actor's log-probs of what is kept. `lend_to`: the learners' train call
        this collection overlaps (async), which then gets the collecting side's idle cores."""
        t = self.cfg.trainer
        state, stats = self.stream.state(), CollectStats()
        groups = self._collect_round(step, 0, t.prompts_per_step, stats)
        if t.dynamic_sampling:
            groups += self._refill(step, t.prompts_per_step - len(groups), stats)
        groups = trim_to_ranks(groups, t.group_size, self.cfg.learner.num_ranks)
        batch = Batch.from_groups(groups, state, stats, version_if_empty=self.versions.learner,
                                  advantage_estimator=self.cfg.algo.advantage_estimator)
        if self.reference is not None and batch.examples and not stats.every_group_failed():  # else not trained on
            # The frozen reference depends on the tokens alone, so it belongs to collecting: in the
            # async schedule it then runs while the learner trains on the previous batch.
            t0 = time.perf_counter()
            batch.ref_logp = self.reference(batch.prompt_ids, batch.completion_ids)
            stats.ref_s = time.perf_counter() - t0
        if self.lend and lend_to is not None:  # collected before that train call ended: lend it the cores
            self.learners.lend_threads(lend_to, self.lend)
        return batch

    def _refill(self, step: int, missing: int, stats: CollectStats) -> list[ScoredGroup]:
        """DAPO dynamic sampling: groups whose rewards are all equal carry no signal and were dropped;
        replace them from more prompts, at most `trainer.max_extra_prompts` per step."""
        out: list[ScoredGroup] = []
        budget, round_ = self.cfg.trainer.max_extra_prompts, 1
        while len(out) < missing and budget > 0 and not stats.every_group_failed():  # no function scores: no refill
            n = min(missing - len(out), budget)
            budget -= n
            stats.extra_prompts += n
            out += self._collect_round(step, round_, n, stats)
            round_ += 1
        return out

    def _collect_round(self, step: int, round_: int, n: int, stats: CollectStats) -> list[ScoredGroup]:
        """Take n prompts, generate G completions each, score them; returns the groups worth training on."""
        t, G = self.cfg.trainer, self.cfg.trainer.group_size
        examples = self.stream.take(n)
        sw = Stopwatch()
        with sw("gen"), self.engines_lock:
            rollouts = self._generate(examples, G, [sample_seed(t.seed, step, round_, i) for i in range(n)], stats=stats,
                                      what=f"step {step + 1}")
        with sw("reward"):
            live = [(ex, ro) for ex, ro in zip(examples, rollouts) if not ro.skipped]
            stats.skipped_prompts += len(examples) - len(live)
            m = self.cfg.metrics
            groups = score_groups(self.scorer, live, G, stats, max_new_tokens=self.cfg.rollout.model_token_cap(),
                                  dynamic_sampling=t.dynamic_sampling, eos_id=self.eos_id,
                                  samples=m.completions_per_step if m.log_completions else 0)
        # A reward function that failed (even every call, even every sample's) does not stop collecting: the
        # trainer writes the step's metrics row first, then its health guard halts (Trainer._check_health).
        stats.gen_s += sw.t["gen_s"]
        stats.reward_s += sw.t["reward_s"]
        return groups

    def _generate(self, examples: list[Example], G: int, seeds: list[int], greedy: bool = False,
                  stats: CollectStats | None = None, what: str = "", activity: str | None = None) -> list:
        """G completions per example from the engines: single-turn, or with `rollout.env` multi-turn
        trajectories (actors/multiturn/trajectories.py) that the rest of the step reads the same way. Environment
        failures are said when they happen (`what`: when, for the message). `activity`: what the waiting
        lines say an engine is doing, "{}" its number of prompts (None: generating / running conversations)."""
        if not self.cfg.rollout.env:
            return self.pool.generate([e.prompt_ids for e in examples], G, seeds, greedy=greedy,
                                      expected_version=self.versions.sent, activity=activity)
        fmt = multiturn_format(self.cfg)
        rollouts = self.pool.generate_multiturn([conversation(e.prompt, fmt) for e in examples],
                                                [e.fields for e in examples], G, seeds, greedy,
                                                expected_version=self.versions.sent, activity=activity)
        if stats is not None:
            stats.add_trajectories(rollouts)
        for line in self.env_notes.lines(rollouts, what):
            print(line, file=sys.stderr, flush=True)
        return rollouts

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, ex: list[Example], step: int) -> dict:
        """Held-out prompts `ex`: greedy accuracy and pass@k (k samples each; none at trainer.eval_pass_k=0)
        at the loop's `step`, and the seconds it took (eval_s).
        Correct = the verdict of the configured answer checker (gsm8k, math_verify, exact_match; see
        RewardScorer.judge)."""
        t, k, t0 = self.cfg.trainer, self.cfg.trainer.eval_pass_k, time.perf_counter()
        with self.engines_lock:
            what = f"the evaluation at step {step}"
            greedy = self._generate(ex, 1, [0] * len(ex), greedy=True, what=what,
                                    activity="evaluating: {} held-out prompts, greedy")
            # pass@k: k more samples per prompt, the evaluation's dearest part (trainer.eval_pass_k, 0: none)
            sampled = self._generate(ex, k,  # same seeds at every evaluation
                                     [sample_seed(t.seed, -1, 0, i) for i in range(len(ex))], what=what,
                                     activity=f"evaluating: {{}} held-out prompts x {k} samples, pass@{k}") if k else []

        # one judge call for every completion (user code and math_verify fan out over the scorer's processes)
        pairs = [(i, c) for i, g in enumerate(greedy) for c in g.completions[:1]]
        pairs += [(len(ex) + i, c) for i, s in enumerate(sampled) for c in s.completions]
        verdicts = self.scorer.judge([ex[i % len(ex)].prompt for i, _ in pairs], [c for _, c in pairs],
                                     [ex[i % len(ex)].fields for i, _ in pairs])
        right = [False] * (2 * len(ex))
        for (i, _), v in zip(pairs, verdicts):
            right[i] = right[i] or v
        ok, passk = right[:len(ex)], right[len(ex):]
        m = {"accuracy": sum(ok) / len(ex), **({f"pass@{k}": sum(passk) / len(ex)} if k else {}), "num_prompts": len(ex)}
        if self.cfg.rollout.env:  # how often the greedy trajectories call the environment's tools
            calls = [g.completions[0].tool_calls if g.completions else 0 for g in greedy]
            m |= {"tool_calls_per_trajectory": sum(calls) / len(ex), "tool_call_rate": sum(c > 0 for c in calls) / len(ex)}
        m["eval_s"] = time.perf_counter() - t0  # its cost; the ETA expects the next evaluations to take as long
        return m
