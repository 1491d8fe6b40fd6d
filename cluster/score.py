"""`raygrpo score CONFIG FILE.jsonl [--out SCORES.jsonl]`: the config's reward functions on hand-written rows,
before training. Nothing of a run starts: no engine, no learner (a `model:PATH` entry's reward model is the
one actor, on a local Ray).

Each input line is a JSON object: `completion` (the text to score), `prompt` (a string or chat messages;
"" when absent) and the dataset's other fields (`answer`, `test_list`, ...), as the reward functions
receive them in training. The console gets, per row, the total and each function's score, and for a code
reward (`code_tests`) every test's outcome; then each function's mean. `--out` writes one row per input
row, in order:

    {"reward": 1.0, "rewards": {"code_tests": 1.0}, "tests": [{"test", "outcome", "detail"}, ...]}

`reward` is the total (null: no function could score the row); `rewards` maps each function's name to its
score, null where it failed (the error is printed) or returned null; `tests` only where a code reward ran.
Each row is its own group: a function that fails a row is left out of that row's total, as in training.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from actors.config import RewardConfig
from actors.rewards.scorer import RewardResult, RewardScorer
from cluster.run.completions import finite_or_none, test_lines


def read_rows(path: str | Path) -> list[dict]:
    """The rows of FILE.jsonl; a ValueError names the line that is not a JSON object with a `completion`."""
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        if not isinstance(row, dict) or not isinstance(row.get("completion"), str):
            raise ValueError(f"{path}:{n}: each line must be a JSON object with a `completion` string (and `prompt` "
                             "and the dataset's fields)")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def _attach_reward_models(scorer: RewardScorer, cfg: RewardConfig, timeout_s: float) -> None:
    """model:PATH entries are scored by a RewardModelActor: started here on a local Ray, as the bench does."""
    paths = scorer.actor_paths()
    if not paths:
        return
    import ray

    from actors.rewards.model_actor import RewardModelActor  # noqa: PLC0415 - torch: model:PATH entries only

    ray.init(num_cpus=max(1, math.ceil(cfg.model_num_cpus * len(paths))), include_dashboard=False,
             ignore_reinit_error=True, log_to_driver=False)
    actor = ray.remote(RewardModelActor).options(num_cpus=cfg.model_num_cpus, num_gpus=cfg.model_num_gpus)
    scorer.attach({spec: actor.remote(path, cfg) for spec, path in paths.items()}, timeout_s)


def score_rows(cfg: RewardConfig, rows: list[dict], max_new_tokens: int | None = None,
               actor_timeout_s: float = 600.0) -> tuple[RewardResult, dict[str, str]]:
    """(the scorer's result over `rows`, spec -> the function's name)."""
    with RewardScorer(cfg) as scorer:
        _attach_reward_models(scorer, cfg, actor_timeout_s)
        examples = [{k: v for k, v in row.items() if k not in ("prompt", "completion")} for row in rows]
        result = scorer.score([row.get("prompt", "") for row in rows], [row["completion"] for row in rows], examples,
                              max_new_tokens=max_new_tokens)
        return result, dict(scorer.names)


def out_rows(result: RewardResult, names: dict[str, str]) -> list[dict]:
    """One --out row per input row: reward, rewards (name -> score | null), tests (code rewards only)."""
    rows = []
    for i, total in enumerate(result.rewards):
        row = {"reward": finite_or_none(total),
               "rewards": {names[spec]: finite_or_none(values[i]) for spec, values in result.per_function.items()}}
        if result.tests and result.tests[i] is not None:
            row["tests"] = [{"outcome": t["outcome"], "detail": t["detail"], "test": t["test"]} for t in result.tests[i]]
        rows.append(row)
    return rows


def report(rows: list[dict], scored: list[dict]) -> list[str]:
    """What the console shows: per row its scores and tests, then per function its mean."""
    def num(v):
        return "error" if v is None else f"{v:.3f}"

    lines = []
    for n, (row, got) in enumerate(zip(rows, scored), 1):
        parts = ", ".join(f"{name} {num(v)}" for name, v in got["rewards"].items())
        lines.append(f"row {n}: reward {num(got['reward'])} ({parts})  {row['completion'][:60]!r}")
        lines += test_lines(got.get("tests") or [], "    ")
    for name in scored[0]["rewards"]:
        values = [r["rewards"][name] for r in scored if r["rewards"][name] is not None]
        mean = f"mean {sum(values) / len(values):.3f}" if values else "no score"
        lines.append(f"{name}: {mean} over {len(values)} of {len(scored)} row(s)")
    return lines


def run_score(cfg: RewardConfig, path: str | Path, out_path: str | Path | None, max_new_tokens: int | None = None,
              actor_timeout_s: float = 600.0, out=print) -> int:
    rows = read_rows(path)
    result, names = score_rows(cfg, rows, max_new_tokens, actor_timeout_s)
    scored = out_rows(result, names)
    for line in report(rows, scored):
        out(line)
    if out_path:
        with open(out_path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in scored)
        out(f"wrote {len(scored)} row(s) to {out_path}")
    return 0
