"""`raygrpo bench --parts code`: code rewards' throughput (README, "Code rewards"), with no Ray, engine or
learner: programs per second through the sandbox at `reward.code_workers` 1, 2 and 4 on two sets, and the
seconds one step's scoring takes.

    recipe   the code recipe's data (cluster/models/codetasks.py): its reference solutions and as many
             wrong ones (5 asserts each), what a step of `raygrpo demo --recipe code` scores
    slow     programs that take 1 s each (a sleep at their top), one test each: where scoring is bound
             by the programs' own time, and parallelism is what helps

`step_s` is the scoring of one step's batch of the recipe (trainer.prompts_per_step x group_size
programs). Its share of a step is step_s / (that + generation + training): this part does not run a
step, so the share is computed where a run's time is known (a run's metrics give rewards/code_tests/s
beside the step's time); in async and pipeline modes scoring overlaps generation and the share is lower.
"""
from __future__ import annotations

import time

from actors.config import RewardConfig
from actors.rewards.scorer import RewardScorer
from cluster.models.codetasks import KINDS, TRAIN_CONSTANTS, code_task

WORKERS = (1, 2, 4)
STEP_PROGRAMS = 64  # the recipe's trainer.prompts_per_step (8) x group_size (8)
SLOW_PROGRAMS = 8
SLOW_PROGRAM = "```python\nimport time\ntime.sleep(1)\ndef f(x):\n    return x\n```"


def recipe_set(n: int) -> tuple[list, list[str], list[dict]]:
    """n samples of the recipe: reference solutions and wrong programs in turn."""
    tasks = [code_task(kind, k) for kind in KINDS for k in TRAIN_CONSTANTS]
    picked = [tasks[i % len(tasks)] for i in range(n)]
    texts = [t["solution"] if i % 2 == 0 else "```python\ndef f(x):\n    return x\n```" for i, t in enumerate(picked)]
    return [t["prompt"] for t in picked], texts, [{"test_list": t["test_list"]} for t in picked]


def slow_set(n: int) -> tuple[list, list[str], list[dict]]:
    return ["p"] * n, [SLOW_PROGRAM] * n, [{"test_list": ["assert f(1) == 1"]}] * n


def programs_per_s(level: str, workers: int, samples: tuple) -> dict:
    """{"programs", "seconds", "programs_per_s"} of one scoring call over `samples`."""
    prompts, texts, rows = samples
    cfg = RewardConfig(functions=["code_tests"], code_sandbox=level, code_workers=workers, code_timeout_s=10.0)
    with RewardScorer(cfg) as scorer:
        t0 = time.perf_counter()
        result = scorer.score(prompts, texts, rows)
        seconds = time.perf_counter() - t0
    if result.errors:
        raise RuntimeError(f"code bench: {result.errors} scoring error(s), first: {result.error_samples[:1]}")
    return {"programs": len(texts), "seconds": round(seconds, 3), "programs_per_s": round(len(texts) / seconds, 2)}


def run_part(res: dict, progress, level: str = "strict") -> None:
    out = res["code"] = {"level": level, "recipe": {}, "slow": {}}
    for workers in WORKERS:
        out["recipe"][workers] = programs_per_s(level, workers, recipe_set(STEP_PROGRAMS))
        out["slow"][workers] = programs_per_s(level, workers, slow_set(SLOW_PROGRAMS))
        progress(f"code rewards ({level}), {workers} worker(s): recipe {out['recipe'][workers]['programs_per_s']} "
                 f"programs/s ({out['recipe'][workers]['seconds']} s for a step's {STEP_PROGRAMS}), slow "
                 f"{out['slow'][workers]['programs_per_s']} programs/s")
    out["step_s"] = {w: r["seconds"] for w, r in out["recipe"].items()}
