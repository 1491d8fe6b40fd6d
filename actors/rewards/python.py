"""The Python kind of `reward.functions` entry: a built-in (`exact_match`, `gsm8k`, ...; functions.py)
or user code as `path/to/file.py:function`.

Built-ins run in-process (fast, trusted), except those in ISOLATED (`math_verify`); user code and
ISOLATED built-ins run in isolated worker processes (pool.py), with `reward.timeout_s` per call.
A function's metric name is the built-in's name or the user function's `__name__`.

Deliberately light: no torch import.
"""
from __future__ import annotations

import os
import time

from actors.config import RewardConfig
from actors.rewards.base import Batch, KindRunner, RewardKind, Tally, columns, safe_name, trl_completion
from actors.rewards.functions import ISOLATED, REWARDS
from actors.rewards.pool import TIMED_OUT, RewardPool, call_one
from actors.runtime.user_code import is_file_spec


def _chunks(n: int, k: int) -> list[list[int]]:
    size, extra = divmod(n, k)
    out, start = [], 0
    for i in range(k):
        end = start + size + (1 if i < extra else 0)
        out.append(list(range(start, end)))
        start = end
    return out


def _in_process(spec: str) -> bool:
    return spec in REWARDS and spec not in ISOLATED


class PythonKind(RewardKind):
    name = "python"

    @property
    def form(self) -> str:
        return f"registered: {', '.join(sorted(REWARDS))}, or user code as 'path/to/file.py:function_name'"

    def recognises(self, spec: str) -> bool:
        return spec in REWARDS or is_file_spec(spec)

    def resolve(self, spec: str) -> str:
        if spec in REWARDS:
            return spec
        path, _, fn = spec.rpartition(":")
        return f"{os.path.abspath(path)}:{fn}"

    def default_name(self, spec: str, loaded: dict[str, str]) -> str:
        if spec in REWARDS:
            return safe_name(spec)
        return safe_name(loaded.get(spec) or spec.rpartition(":")[2])

    def problems(self, spec: str) -> list[str]:
        if spec in REWARDS:
            return []
        path = spec.rpartition(":")[0]
        if not os.path.isfile(path):
            return [f"reward function file not found: {path} (from {spec!r}, cwd {os.getcwd()})"]
        return []

    def timeout_setting(self, spec: str, cfg: RewardConfig) -> str | None:
        return None if _in_process(spec) else f"reward.timeout_s={cfg.timeout_s:g}"

    def start(self, specs: list[str], cfg: RewardConfig) -> PythonFunctions:
        return PythonFunctions(specs, cfg)


class PythonFunctions(KindRunner):
    """The in-process built-ins, and one RewardPool for every function that runs isolated."""

    def __init__(self, specs: list[str], cfg: RewardConfig):
        self.cfg = cfg
        isolated = [s for s in specs if not _in_process(s)]
        self.pool: RewardPool | None = RewardPool(isolated, cfg.num_procs, cfg.timeout_s) if isolated else None
        self.names = dict(self.pool.names) if self.pool else {}

    def send(self, specs: list[str], batch: Batch, tally: Tally, progress):
        """Scored here, on this thread and the pool's processes: every other kind was sent its work first."""
        n = len(batch)
        pool_calls, where = [], []
        for spec in specs:
            if _in_process(spec):
                for i in range(n):
                    try:
                        tally.record(spec, i, True, call_one(REWARDS[spec], batch.prompts[i], batch.texts[i], batch.fields[i]))
                    except Exception as e:  # noqa: BLE001 - a failing reward is counted, not fatal
                        tally.record(spec, i, False, f"{type(e).__name__}: {e}")
                tally.stats[spec].calls, tally.stats[spec].seconds = n, time.monotonic() - tally.t0
            elif self.pool is not None and spec in self.pool.specs:
                calls = list(self._pool_calls(spec, batch))
                pool_calls += [(spec, call) for call, _ in calls]
                where += [(spec, idx) for _, idx in calls]
                progress.add(spec, len(calls))
        if pool_calls:
            for (spec, idx), (ok, value) in zip(where, self.pool.run(pool_calls, progress)):
                tally.stats[spec].calls += 1
                tally.stats[spec].timeouts += (not ok and str(value).startswith(TIMED_OUT))
                for k, i in enumerate(idx):
                    tally.record(spec, i, ok, value[k] if ok and isinstance(value, list) else value)
        return lambda: None

    def _pool_calls(self, spec: str, batch: Batch):
        """(call, sample indices) for one pooled function: per sample, or TRL-style chunks."""
        if self.pool.batched.get(spec):
            for chunk in (c for c in _chunks(len(batch), self.cfg.num_procs) if c):
                yield ("batch", [batch.prompts[i] for i in chunk],
                       [trl_completion(batch.prompts[i], batch.texts[i]) for i in chunk],
                       columns(chunk, batch.ids, batch.fields)), chunk
        else:
            for i in range(len(batch)):
                yield ("one", batch.prompts[i], batch.texts[i], batch.fields[i]), [i]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
