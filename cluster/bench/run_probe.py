"""A short `raygrpo train` in a child process, measured as `raygrpo plan` predicts it: the median of each
phase's seconds over the steps after the first (the first pays the engines' and the learner's warm-up), the
learner's peak memory (the step lines' learner_peak_bytes), and the machine's load before and after.

The child keeps this process's niceness for its driver and Ray's head; Ray starts the run's engines and
learner ranks at its worker niceness, 15, at which the calibration measures its points (calibrate.py).
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from cluster.run.jsonl import read_jsonl

MEDIAN_KEYS = ("step_s", "gen_s", "reward_s", "ref_s", "train_s", "sync_s")
TAIL_CHARS = 3000


class RunFailed(RuntimeError):
    pass


def measured_of(rows: list[dict]) -> dict:
    """Medians of MEDIAN_KEYS over the train rows after the first, and the largest learner_peak_bytes."""
    train = [r for r in rows if r.get("kind", "train") == "train" and r.get("step_s") is not None]
    later = train[1:] or train
    out: dict = {"steps": len(later)}
    for k in MEDIAN_KEYS:
        vals = [r[k] for r in later if isinstance(r.get(k), (int, float))]
        out[k] = statistics.median(vals) if vals else 0.0
    peaks = [r["learner_peak_bytes"] for r in train if isinstance(r.get("learner_peak_bytes"), (int, float))]
    out["learner_peak_bytes"] = max(peaks) if peaks else None
    return out


def train_and_measure(config: dict, overrides: list[str], run_dir: Path, timeout_s: float = 1800) -> dict:
    """Train `config` (a dict, written as run_dir/config.yaml) + `overrides`; its measured_of, load, wall time."""
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = run_dir.parent / f"{run_dir.name}.yaml"
    cfg_path.write_text(yaml.safe_dump(config, sort_keys=False))
    cmd = [sys.executable, "-m", "cluster.cli", "train", str(cfg_path), *overrides, f"trainer.run_dir={run_dir}",
           "checkpoint.resume=none", "--overwrite"]
    load_before, t0 = os.getloadavg()[0], time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    (run_dir.parent / f"{run_dir.name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RunFailed(f"{' '.join(cmd)} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-TAIL_CHARS:]}")
    out = measured_of(read_jsonl(run_dir / "metrics.jsonl")[0])
    out.update(load_before=load_before, load_after=os.getloadavg()[0], wall_s=time.time() - t0)
    return out
