"""3. Sync vs async schedule step time, and held-out accuracy of a trained model."""
from __future__ import annotations

import json
import shutil
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from cluster.bench.model_bench import MemorySampler
from cluster.bench.report import progress, schedule_summary
from cluster.config import load_config
from cluster.data.dataset import load_splits
from cluster.driver.trainer import Trainer
from cluster.models.warmstart import greedy_accuracy


def heldout_examples(data: dict, seed: int):
    return load_splits(data["train"], data["eval"], data["num_eval"], data["task_digits"], seed)[1]


def heldout_accuracy(model_dir: str, data: dict, seed: int, max_new_tokens: int) -> float | None:
    """Greedy exact-match accuracy of a saved model on the held-out split, with HF generate on one
    thread: the one procedure applied to the starting model, raygrpo's result and TRL's result."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    examples = heldout_examples(data, seed)
    if not examples:
        return None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        return greedy_accuracy(model, AutoTokenizer.from_pretrained(model_dir), examples, max_new_tokens=max_new_tokens)
    finally:
        torch.set_num_threads(threads)


def bench_schedule(config_overrides: list[str], mode: str, run_dir: Path,
                   memory: dict | None = None) -> tuple[dict, list[dict]]:
    """A short `Trainer(cfg).run()` in `mode`; returns (summary, metrics rows). With a `memory` dict, the
    actors' resident memory during the training steps is sampled into it, also when the run fails (a
    machine short of memory is where the figure matters most)."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    cfg = load_config(None, [*config_overrides, f"trainer.mode={mode}", f"trainer.run_dir={run_dir}"])
    progress(f"schedule: trainer.mode={mode}, {cfg.trainer.steps} steps x {cfg.trainer.prompts_per_step} prompts x "
             f"G={cfg.trainer.group_size}, run dir {run_dir}")
    t = time.perf_counter()
    ref_on_learner = cfg.algo.beta > 0 and cfg.reference_on_learner()
    mem = MemorySampler(run_dir / "metrics.jsonl", cfg.trainer.steps) if memory is not None else None
    try:
        with mem or nullcontext():
            out = Trainer(cfg).run()
    finally:  # after the sampler's thread has stopped
        if mem is not None:
            memory.update(mem.result(cfg.learner.micro_batch_size, ref_on_learner))
    total = time.perf_counter() - t
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("kind", "train") == "train"]
    summary = schedule_summary(rows, skip=1, ref_collecting=cfg.algo.beta > 0 and not cfg.reference_on_learner())
    summary["run_wall_s"] = total
    summary["trainer_eval"] = {"before": out.get("before"), "after": out.get("after")}  # vLLM greedy, pass@k
    summary["hf_model"] = out.get("hf_model")
    summary["reference_on_learner"] = ref_on_learner
    # the thread budget each actor got (cluster/launch/thread_budget.py), as the run recorded it
    summary["threads"] = {p["role"]: p.get("threads") for p in json.loads((run_dir / "placement.json").read_text())}
    return summary, rows
