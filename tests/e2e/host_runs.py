"""What the tests on hosts with their own addresses (tests/hosts.py) share: `raygrpo train` on host a joining
its Ray head as a user does (no RAY_* variable, the venv not on PATH), and the training rows it logs.

The run is small and fixed in size so that what a host holds is known: a learner rank takes 2 CPUs, an engine
1, and there is no reference actor (algo.beta=0)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import hosts

BIN = Path(sys.executable).parent


def train_rows(run_dir: Path) -> list[dict]:
    """The run's training rows so far (a line still being written is skipped)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in (json.loads(x) for x in path.read_text().splitlines() if x.strip().endswith("}"))
            if r.get("kind") == "train"]


def train(head: hosts.Host, model_dir, run_dir: Path, steps: int, extra: list[str], out) -> subprocess.Popen:
    """`raygrpo train` on the head's host, joined to its cluster; `extra`: the test's own settings."""
    return head.popen(
        [str(BIN / "raygrpo"), "train", "examples/cpu_demo.yaml", f"ray.address={head.address}:{hosts.GCS_PORT}",
         f"model.path={model_dir}", f"trainer.run_dir={run_dir}", f"trainer.steps={steps}",
         "trainer.prompts_per_step=4", "trainer.group_size=2",
         "trainer.dynamic_sampling=false", "trainer.eval_every=0", "data.num_eval=0", "data.task_digits=1",
         "rollout.num_cpus=1", "learner.num_cpus=2", "rollout.max_model_len=48", "rollout.max_new_tokens=4",
         "rollout.gpu_memory_utilization=0.03", "rollout.cpu_kv_cache_mb=32", "algo.beta=0",
         "metrics.tensorboard=false", "trainer.halt_after=0", *extra],
        env=hosts.USER_ENV, log=out)
