"""`raygrpo demo`: the first thing a new user runs. Shows GRPO learning, end to end, on a CPU.

1. build (or reuse) a small Qwen2 model offline, 2. warm-start it briefly on the task's
format (supervised, cached), 3. train it with GRPO through the full system (Ray, vLLM
rollout worker, DeepSpeed learner, reference actor, weight sync after every step),
4. print held-out accuracy before and after, side by side, and where everything is.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

from cluster.paths import PROJECT_ROOT
from cluster.tinymodel import TinyModelSpec, build_tiny_model, num_parameters
from cluster.warmstart import WarmStartSpec, warm_start

DEMO_CONFIG = PROJECT_ROOT / "examples" / "cpu_demo.yaml"
# Chosen so GRPO has room to improve: big enough to learn 2-digit addition, warm start short
# enough that the starting accuracy is well below the ceiling (see docs/STATUS.md).
DEMO_MODEL = TinyModelSpec(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512, seed=0)
DEMO_WARM_START = WarmStartSpec(steps=900, batch_size=64, lr=1e-3, seed=0)


def run_demo(args) -> int:
    from cluster.config import load_config
    from cluster.data import load_splits
    from cluster.metrics import plot_run
    from cluster.trainer import Trainer

    t0 = time.time()
    cache = Path(args.cache_dir)
    base = build_tiny_model(cache / "base-qwen2-h128-l4", DEMO_MODEL)
    print(f"[1/4] base model: {base} ({num_parameters(base) / 1e6:.2f}M parameters, built offline)")
    overrides = [f"trainer.run_dir={args.run_dir}", *args.overrides]
    if args.steps is not None:
        overrides.append(f"trainer.steps={args.steps}")
    cfg = load_config(DEMO_CONFIG, [f"model.path={base}", *overrides])
    train_set, _ = load_splits(cfg.data.train, cfg.data.eval, cfg.data.num_eval, cfg.data.task_digits, cfg.trainer.seed)
    warm = warm_start(base, cache / f"warm-{DEMO_WARM_START.steps}", train_set, DEMO_WARM_START)
    print(f"[2/4] warm-started model (supervised, {DEMO_WARM_START.steps} steps, cached): {warm}")
    cfg = load_config(DEMO_CONFIG, [f"model.path={warm}", *overrides])
    if Path(cfg.trainer.run_dir).exists():  # a demo starts fresh; a real run would resume from its checkpoint
        shutil.rmtree(cfg.trainer.run_dir)
    print(f"[3/4] GRPO: {cfg.trainer.steps} steps x {cfg.trainer.prompts_per_step} prompts x G={cfg.trainer.group_size}, "
          f"run dir {cfg.trainer.run_dir}")
    summary = Trainer(cfg).run()
    plots = plot_run(summary["run_dir"])
    before, after = summary["before"], summary["after"]
    k = cfg.trainer.eval_pass_k
    print(f"\n[4/4] held-out evaluation ({before['num_prompts']} unseen prompts)")
    print(f"    {'':24}{'before':>10}{'after':>10}")
    print(f"    {'accuracy (greedy)':24}{before['accuracy']:>10.3f}{after['accuracy']:>10.3f}")
    print(f"    {f'pass@{k}':24}{before[f'pass@{k}']:>10.3f}{after[f'pass@{k}']:>10.3f}")
    run_dir = Path(summary["run_dir"])
    print(f"\n    run dir:      {run_dir}")
    print(f"    metrics:      {run_dir / 'metrics.jsonl'}  (TensorBoard: {run_dir / 'tensorboard'})")
    print(f"    reward plot:  {plots[0]}")
    print(f"    HF model:     {summary['hf_model']}")
    print(f"    checkpoint:   {summary['checkpoint']}")
    print(f"    took {(time.time() - t0) / 60:.1f} min")
    print("\n    on a cluster: raygrpo submit examples/multinode.yaml --address http://HEAD:8265 model.path=/shared/model")
    return 0
