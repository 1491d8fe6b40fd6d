"""RewardEntries: the `reward.functions` entries of a run, checked, named and started.

What the scorer (scorer.py) scores with, and what the driver asks of it before and between steps: the
entries as specs (paths made absolute), their weights and kinds (registry.py), the runner that scores
each kind, the metric name of each entry, the actors a kind needs (reward models: the driver starts
them and attaches their handles), and what bounds one call. The scorer holds one and answers the
driver's questions from it; scoring a batch is the scorer's own concern.
"""
from __future__ import annotations

from actors.config import RewardConfig
from actors.rewards.base import KindRunner, RewardKind, safe_name
from actors.rewards.registry import KINDS, default_name, kind_for, resolve, spec_problems

# Per reward function and step, metrics rewards/<name>/<stat>: TRL's mean and std (over the values it
# gave), then errors, unscorable samples (nulls) and seconds; a kind may add its own (reward models: `truncated`).
REWARD_STATS = ("mean", "std", "errors", "unscorable", "s")


def config_problems(cfg: RewardConfig) -> list[str]:
    """Everything that keeps `cfg` from scoring anything, each naming its key."""
    problems = cfg.problems() + [p for s in cfg.functions for p in spec_problems(s)]
    twice = sorted({s for s in cfg.functions if cfg.functions.count(s) > 1})
    if twice:
        problems.append(f"reward.functions lists {', '.join(twice)} more than once (give it a larger reward.weights entry)")
    return problems


class RewardEntries:
    """The configured entries: specs, weights, kinds, names, and each kind's runner (started here)."""

    def __init__(self, cfg: RewardConfig):
        """Fails at start, clearly, on a config that cannot score anything (every problem at once)."""
        self.cfg = cfg
        problems = config_problems(cfg)
        if problems:
            raise ValueError("invalid RewardConfig: " + "; ".join(problems))
        self.specs = [resolve(s) for s in cfg.functions]  # paths made absolute: they cross into other processes
        self.weights = dict(zip(self.specs, list(cfg.weights) or [1.0] * len(self.specs)))
        self.kinds: dict[str, RewardKind] = {s: kind_for(s) for s in self.specs}
        self.runners: dict[str, KindRunner] = {}  # kind name -> its entries, started (in KINDS order)
        try:
            for name, kind in KINDS.items():
                if any(k is kind for k in self.kinds.values()):
                    self.runners[name] = kind.start([s for s in self.specs if self.kinds[s] is kind], cfg)
        except BaseException:
            self.close()
            raise
        loaded = {spec: n for r in self.runners.values() for spec, n in r.names.items()}
        defaults = [default_name(s, loaded) for s in self.specs]
        self.names = dict(zip(self.specs, [safe_name(n) for n in cfg.names] or defaults))
        taken = [n for n in self.names.values() if list(self.names.values()).count(n) > 1]
        if taken:
            self.close()
            raise ValueError(f"two reward functions share the metric name {taken[0]!r}; give each its own "
                             f"with reward.names (one per reward.functions entry)")

    def runner(self, kind: RewardKind) -> KindRunner:
        """The kind's runner; started empty for a function scored without being configured (judge's exact_match)."""
        if kind.name not in self.runners:
            self.runners[kind.name] = kind.start([], self.cfg)
        return self.runners[kind.name]

    def actor_paths(self) -> dict[str, str]:
        """Entry -> the model directory the driver starts an actor with (reward models), then `attach`es."""
        return {s: path for s in self.specs if (path := self.kinds[s].actor_path(s)) is not None}

    def attach(self, handles: dict, timeout_s: float) -> None:
        """The actors the driver started for `actor_paths()` (entry -> Ray actor handle): the scorer calls
        them itself, each call waited for at most `timeout_s` (trainer.actor_timeout_s)."""
        for spec, handle in handles.items():
            self.runners[self.kinds[spec].name].attach(spec, handle, timeout_s)

    def restarted_actors(self) -> list[str]:
        """The entries whose actor Ray restarted since the last call (the driver gives each its threads again
        and updates placement.json)."""
        return [spec for runner in self.runners.values() for spec in runner.restarted_actors()]

    def restarts(self) -> int:
        """Calls answered by a restarted actor (Ray restarted a dead reward model and ran the call again)."""
        return sum(r.restarts for r in self.runners.values())

    def data_problems(self, chat: bool) -> list[str]:
        """What keeps these functions from scoring the run's data (chat: its prompts are messages)."""
        return [p for s in self.specs for p in self.kinds[s].data_problems(s, chat)]

    def metric_keys(self) -> list[str]:
        """Every per-function metric a step reports (cluster/run/metrics.py logs exactly these beside STEP_KEYS)."""
        return [f"rewards/{self.names[s]}/{stat}" for s in self.specs for stat in REWARD_STATS + self.kinds[s].stats]

    def timeout_setting(self, name: str) -> str | None:
        """The setting that bounds one call of the function called `name` ("reward.timeout_s=10"), if any."""
        spec = next(s for s in self.specs if self.names[s] == name)
        return self.kinds[spec].timeout_setting(spec, self.cfg)

    def close(self) -> None:
        """Stop every runner (their worker processes, clients); emptied in place, so a holder's view stays true."""
        for runner in self.runners.values():
            runner.close()
        self.runners.clear()
