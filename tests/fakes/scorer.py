"""FakeScorer: the reward scorer as the driver sees it (actors/rewards/scorer.py RewardScorer: score, judge, names,
restarts, ...). Each function is a plain callable of (completion text, the example's fields); one named in
`failing` fails every sample, as a verifier answering 500 does, and the weighted sum is the real scorer's
`combine`, so what the driver is handed for a failed function (left out and the others renormalised, or
reward.fallback) is what the real one hands it."""
from __future__ import annotations

import math

from actors.rewards.base import FunctionStats
from actors.rewards.scorer import RewardResult, combine


class FakeScorer:
    def __init__(self, functions: dict, weights: dict[str, float] | None = None, fallback: float = 0.0,
                 timeout_s: float = 10.0):
        self.functions = functions  # spec -> fn(text, fields) -> float | None
        self.names = {spec: spec for spec in functions}  # spec -> its name in the metrics
        self.weights = weights or dict.fromkeys(functions, 1.0)
        self.fallback, self.timeout_s = fallback, timeout_s
        self.failing: set[str] = set()  # specs that fail every sample
        self.calls = 0

    @property
    def restarts(self) -> int:
        return 0  # no reward-model actors here

    def restarted_actors(self) -> list[str]:
        return []

    def metric_keys(self) -> list[str]:
        return []

    def timeout_setting(self, name: str) -> str | None:
        return f"reward.timeout_s={self.timeout_s:g}"

    def score(self, prompts: list, completions: list, examples: list[dict], max_new_tokens: int | None = None,
              group_size: int | None = None) -> RewardResult:
        self.calls += 1
        texts = [getattr(c, "text", c) for c in completions]
        values = {s: [math.nan if s in self.failing else fn(t, f) for t, f in zip(texts, examples)]
                  for s, fn in self.functions.items()}
        rewards, unscorable, failed = combine(values, self.weights, [0.0] * len(texts), self.fallback, group_size or 1)
        stats = {self.names[s]: FunctionStats([v for v in vs if v is not None and not math.isnan(v)],
                                              errors=sum(v is not None and math.isnan(v) for v in vs),
                                              unscorable=vs.count(None), calls=len(vs), seconds=0.0,
                                              first_error="HTTP 500 (fake)" if s in self.failing else None)
                 for s, vs in values.items()}
        errors = sum(st.errors for st in stats.values())
        return RewardResult(rewards, errors, ["HTTP 500 (fake)"] if errors else [], 0.0, values, stats,
                            sum(unscorable), failed)

    def judge(self, prompts: list, completions: list, examples: list[dict]) -> list[bool]:
        return [r > 0 for r in self.score(prompts, completions, examples).rewards]

    def close(self) -> None:
        pass
