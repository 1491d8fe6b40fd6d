"""The held-out evaluation of a multi-turn run (rollout.env set): beside accuracy and pass@k, how often its greedy
trajectories call the environment's tools (tool_calls_per_trajectory, tool_call_rate: the `kind: eval` rows, and
the rows the tools recipe's results print). The real Collector.evaluate over test_collect.py's fakes, with a pool
whose conversations carry the tool calls each made; the multi-turn runs with engines are tests/e2e/test_multiturn.py."""
from __future__ import annotations

import dataclasses

from actors.multiturn.trajectories import MultiTurnRollout, Trajectory
from cluster.driver.collector import Collector
from tests.unit.test_collect import FakePool, trainer


class MultiTurnPool(FakePool):
    """Prompt "p{i}" (token ids [i]): its greedy conversation called the tools CALLS[i] times; the first sample
    is right (FakeScorer.judge: text "c0")."""

    CALLS = [0, 2, 1, 0]

    def generate_multiturn(self, conversations, fields, group_size, seeds, greedy=False, expected_version=None,
                           activity=None):
        self.calls.append(len(conversations))
        self.activities.append(activity)
        self.conversations = conversations
        return [MultiTurnRollout([Trajectory([i], [5, 6], [1, 1], [-0.5, -0.5], text=f"c{j}", finish_reason="stop",
                                             turns=1 + (self.CALLS[i] > 0), tool_calls=self.CALLS[i] if j == 0 else 3)
                                  for j in range(group_size)], weight_version=expected_version)
                for i in range(len(conversations))]


def evaluate(env: str, k: int = 0) -> tuple[dict, MultiTurnPool]:
    t = trainer([[1, 0]] * 4)
    t.cfg.rollout.env, t.cfg.trainer.eval_pass_k = env, k
    t.ctx = dataclasses.replace(t.ctx, pool=MultiTurnPool())
    t.collector = Collector(t.ctx)
    return t.collector.evaluate(t.stream.take(4), step=1), t.ctx.pool


def test_a_multi_turn_evaluation_counts_the_greedy_trajectories_tool_calls():
    m, pool = evaluate("calculator", k=2)
    assert pool.calls == [4, 4] and [c[-1]["content"] for c in pool.conversations] == ["p0", "p1", "p2", "p3"]
    assert m["accuracy"] == 1.0 and m["pass@2"] == 1.0 and m["num_prompts"] == 4
    # the greedy trajectories' calls (0, 2, 1, 0), not the pass@k samples' (3 each)
    assert m["tool_calls_per_trajectory"] == 3 / 4 and m["tool_call_rate"] == 2 / 4


def test_a_single_turn_evaluation_has_no_tool_rows():
    m, pool = evaluate("")
    assert pool.calls == [4] and m["accuracy"] == 1.0
    assert "tool_calls_per_trajectory" not in m and "tool_call_rate" not in m
