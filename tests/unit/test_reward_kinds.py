"""Reward kinds are a table (actors/rewards/registry.py KINDS): a kind added in a test, and nowhere
else, is recognised, checked at start, named, bounded and scored through RewardScorer like the others."""
from __future__ import annotations

import math

import pytest

from actors.config import RewardConfig
from actors.rewards import registry
from actors.rewards.base import KindRunner, RewardKind, safe_name
from actors.rewards.scorer import RewardScorer


class LengthKind(RewardKind):
    """`length:N`: 1.0 for a completion of at most N characters, else 0.0; None for an empty one."""

    name = "length"
    form = "a length limit as 'length:N'"

    def recognises(self, spec):
        return spec.startswith("length:")

    def default_name(self, spec, loaded):
        return safe_name(f"at_most_{spec.split(':')[1]}")

    def problems(self, spec):
        return [] if spec.split(":")[1].isdigit() else [f"{spec!r}: N must be a whole number"]

    def timeout_setting(self, spec, cfg):
        return "length.none=0"

    def start(self, specs, cfg):
        return LengthRunner(specs)


class LengthRunner(KindRunner):
    def __init__(self, specs):
        self.specs, self.closed = specs, False

    def send(self, specs, batch, tally, progress):
        def wait():
            for spec in specs:
                limit = int(spec.split(":")[1])
                tally.stats[spec].calls += 1
                for i, text in enumerate(batch.texts):
                    tally.record(spec, i, True, None if not text else float(len(text) <= limit))
        return wait

    def close(self):
        self.closed = True


@pytest.fixture
def length_kind(monkeypatch):
    monkeypatch.setitem(registry.KINDS, "length", LengthKind())  # the one registry line, here in the test


def test_a_kind_added_to_the_table_scores_through_the_scorer(length_kind):
    cfg = RewardConfig(functions=["length:3", "exact_match"], weights=[2.0, 1.0])
    with RewardScorer(cfg) as scorer:
        runner = scorer.runners["length"]
        assert runner.specs == ["length:3"] and scorer.names["length:3"] == "at_most_3"
        assert scorer.timeout_setting("at_most_3") == "length.none=0"
        assert "rewards/at_most_3/mean" in scorer.metric_keys()
        res = scorer.score(["q"] * 4, ["12", "1234", "12", ""], [{"answer": "12"}] * 4, group_size=2)
    assert runner.closed
    # 2 * length + exact_match; the empty completion's null leaves its group's other sample scored alone
    assert res.rewards[:2] == [2.0 + 1.0, 0.0 + 0.0]
    assert res.rewards[2] == 3.0 and math.isnan(res.rewards[3]) and res.unscorable == 1
    assert res.functions["at_most_3"].values == [1.0, 0.0, 1.0] and res.functions["at_most_3"].unscorable == 1


def test_a_kind_added_to_the_table_is_checked_at_start_and_named_in_the_unknown_entry_error(length_kind):
    with pytest.raises(ValueError, match="'length:x': N must be a whole number"):
        RewardScorer(RewardConfig(functions=["length:x"]))
    with pytest.raises(ValueError, match="unknown reward function 'nope'; .*length:N.*model:PATH"):
        RewardScorer(RewardConfig(functions=["nope"]))


def test_without_it_the_entry_is_unknown():
    with pytest.raises(ValueError, match="unknown reward function 'length:3'"):
        RewardScorer(RewardConfig(functions=["length:3"]))
