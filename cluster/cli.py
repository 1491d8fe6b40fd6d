"""`raygrpo train | data | submit | show | score | export | plot | demo | bench | plan`: the command line.

Errors a user can fix (config, data, model path, reward functions, a dead actor) are printed
as one clear message and exit with status 2 (bad input) or 1 (the run failed), without a
Python traceback; `RAYGRPO_DEBUG=1` shows the traceback too.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from cluster.launch.submit import SUBMIT_EXCLUDES
from cluster.paths import SMOLLM2_FIXTURE
from cluster.run.logs import DEFAULT_LEVEL, LEVEL_ENV, LEVELS, console_level, setup_driver


def _overrides_help() -> str:
    return ("dotted overrides, e.g. trainer.steps=50 rollout.temperature=0.7 (YAML values; a value YAML would "
            "cut at ' #' is taken whole, as text: data.system_prompt='End with #### and the number.')")


def cmd_train(args) -> int:
    from cluster.config import load_config

    cfg = load_config(args.config, args.overrides)  # before the heavy imports: config mistakes fail fast
    print(f"raygrpo train: run dir {cfg.trainer.run_dir}; loading the tokenizer and the data", flush=True)
    from actors.runtime.start_up import few_full_collections

    with few_full_collections():  # torch's and transformers' imports (actors/runtime/start_up.py)
        from cluster.driver.trainer import Trainer

    summary = Trainer(cfg, overwrite=args.overwrite).run()
    print(f"done: run dir {summary['run_dir']}, checkpoint {summary['checkpoint']}, HF model {summary['hf_model']}")
    if summary.get("before") and summary.get("after"):
        print(f"held-out accuracy: {summary['before']['accuracy']:.3f} -> {summary['after']['accuracy']:.3f}")
    return 0


def cmd_data(args) -> int:
    from cluster.config import load_config

    cfg = load_config(args.config, args.overrides)
    from cluster.data.preview import preview

    preview(cfg, args.n)
    return 0


def cmd_submit(args) -> int:
    from cluster.config import load_config
    from cluster.launch.submit import submit
    from cluster.run.logs import quiet_driver_console

    # config mistakes before anything is uploaded; its paths are checked by submit, as the job sees them
    cfg = load_config(Path(args.config), args.overrides, validate_paths=False)
    quiet_driver_console()  # Ray's INFO lines about packaging the upload
    return submit(args, cfg, console_level(args.log_level))


def cmd_show(args) -> int:
    from cluster.run.completions import show

    show(args.run_dir, args.step, args.n)
    return 0


def cmd_score(args) -> int:
    from cluster.config import ConfigError, load_config

    cfg = load_config(args.config, args.overrides, validate_paths=False)  # only the reward section is used
    from cluster.score import run_score

    try:
        return run_score(cfg.reward, args.file, args.out, cfg.rollout.max_new_tokens, cfg.trainer.actor_timeout_s)
    except ValueError as e:  # a bad row, a reward function that cannot start, a sandbox level the machine lacks
        raise ConfigError([str(e)], f"raygrpo score {args.config} {args.file}") from None


def cmd_export(args) -> int:
    from learner.export import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.out_dir, args.model_path, overwrite=args.overwrite)
    print(f"exported {args.checkpoint} -> {out} (load with transformers' from_pretrained or vLLM"
          + ("; LoRA adapter in peft format under adapter/" if (Path(out) / "adapter").is_dir() else "") + ")")
    return 0


def cmd_plot(args) -> int:
    from cluster.run.metrics import plot_run

    for p in plot_run(args.run_dir):
        print(p)
    return 0


def cmd_demo(args) -> int:
    from cluster.demo.demo import run_demo

    return run_demo(args)


def cmd_bench(args) -> int:
    from cluster.bench import run_bench

    return run_bench(args)


def cmd_plan(args) -> int:
    from cluster.plan.command import run_plan

    return run_plan(args)


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def _seed(text: str) -> int:
    if not text.isdigit() or int(text) >= 2**32:
        raise argparse.ArgumentTypeError(f"{text!r} is not a seed: a whole number from 0 to 2**32-1")
    return int(text)


# cluster/demo/recipes.py RECIPES (the CLI imports nothing heavy)
DEMO_RECIPES = ("addition", "lora", "async", "pipeline", "chat", "tools", "reward_model", "smollm2", "code")


# `add(name, help=..., description=...)`: a sub-parser of `raygrpo` that takes the common options
AddCommand = Callable[..., argparse.ArgumentParser]


def _common_options() -> argparse.ArgumentParser:
    """The options every command takes, as the parent parser of each."""
    # every command takes --log-level (README "Logging"): the console threshold of third-party loggers
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default=None, choices=LEVELS, type=str.upper,
                        help=f"third-party loggers (vLLM, Ray, DeepSpeed) at this level or above reach the console "
                        f"(default: ${LEVEL_ENV}, else {DEFAULT_LEVEL}); at {DEFAULT_LEVEL} and ERROR the actors' other "
                        "output (vLLM's INFO lines, progress bars, C++ warnings) goes to RUN_DIR/logs/ instead; INFO or "
                        "DEBUG shows everything. raygrpo's own lines are always shown")
    return common


def _train_parser(add: AddCommand) -> None:
    """`raygrpo train CONFIG [overrides] [--overwrite]`."""
    t = add("train", help="train from a YAML config (+ dotted overrides)",
            description="Train with GRPO. Starts an embedded Ray cluster unless ray.address is set "
            "(ray.address=auto joins the local node's cluster). Resumes from the run dir's latest "
            "complete checkpoint by default (checkpoint.resume=auto|none|PATH). A run dir belongs to "
            "one run: a second live run on it, a config that differs in more than trainer.steps / "
            "checkpoint.resume, or checkpoints that all fail verification are refused. SIGTERM or "
            "SIGINT: the step finishes, a checkpoint is saved (within trainer.stop_grace_s), exit "
            "128+signal; rerunning resumes. A health guard (trainer.halt_after) halts with a "
            "checkpoint, the plots and a diagnosis, exit 3; one that trips at the run's last step ends it "
            "normally, with a warning.")
    t.add_argument("config", help="YAML config, e.g. examples/cpu_demo.yaml")
    t.add_argument("overrides", nargs="*", help=_overrides_help())
    t.add_argument("--overwrite", action="store_true",
                   help="start afresh in trainer.run_dir even if it holds another run: its contents are moved to "
                   "RUN_DIR.replaced-<time> beside it (nothing is deleted)")
    t.set_defaults(fn=cmd_train)


def _data_parser(add: AddCommand) -> None:
    """`raygrpo data CONFIG [overrides] [-n N]`."""
    dp = add("data", help="show the data as training will use it: rendered prompts, reward columns, stats",
             description="Loads the config's data exactly as `train` would (files, chat template, system "
             "prompt, length filter) and prints the first N prompts of step 1 as the engine receives them "
             "(rendered text and token count), the columns the reward functions get, and per split: rows, "
             "filtered rows, prompt-token p50/p95/max. Starts no actor: check a template here first.")
    dp.add_argument("config", help="YAML config, e.g. examples/chat_cpu.yaml")
    dp.add_argument("overrides", nargs="*", help=_overrides_help())
    dp.add_argument("-n", type=int, default=3, help="prompts to print (default 3)")
    dp.set_defaults(fn=cmd_data)


def _submit_parser(add: AddCommand) -> None:
    """`raygrpo submit CONFIG [overrides] --address URL`: the job's upload and its wait."""
    s = add("submit", help="submit `train` as a job to a Ray cluster, with your own files",
            description="Submit a training run through Ray's Job Submission API. The job runs in an uploaded "
            "working dir: --working-dir DIR (default: the config's directory when the config is outside "
            "this checkout), with raygrpo's own code uploaded beside it, so reward and environment files "
            "and data that exist only in DIR reach a cluster whose nodes have never seen them; paths in "
            "the config are relative to DIR. A config inside the checkout uploads the checkout. Never "
            f"uploaded: {', '.join(SUBMIT_EXCLUDES)}. The cluster's Python needs raygrpo's dependencies "
            "installed (see docker/). Waits (--agent-wait) for the cluster's job agent if it is not ready "
            "yet. Follows the logs until the job ends unless --no-wait.")
    s.add_argument("config", help="YAML config (inside --working-dir, or inside this checkout)")
    s.add_argument("overrides", nargs="*", help=_overrides_help())
    s.add_argument("--address", required=True, help="the head's dashboard address, e.g. http://127.0.0.1:8265")
    s.add_argument("--working-dir", default=None, metavar="DIR",
                   help="your project directory, uploaded as the job's working dir (default: the config's directory "
                   "when it is outside this checkout)")
    s.add_argument("--agent-wait", type=float, default=60.0, metavar="SECONDS",
                   help="how long to wait for the cluster's job agent when Ray answers 'No available agent' (default 60)")
    s.add_argument("--no-wait", action="store_true", help="print the job id and return at once")
    s.set_defaults(fn=cmd_submit)


def _show_parser(add: AddCommand) -> None:
    """`raygrpo show RUN_DIR [--step S] [-n N]`."""
    sh = add("show", help="print the sample completions a run logged: prompt, completion, scores",
             description="Reads RUN_DIR/completions.jsonl (metrics.log_completions, a few per step) and "
             "prints the completions of one step: the prompt (or, multi-turn, the whole transcript with "
             "roles), the completion, the reward and each reward function's score, the advantage, the "
             "finish reason and the length.")
    sh.add_argument("run_dir", help="a run directory written by `raygrpo train`")
    sh.add_argument("--step", type=int, default=None, help="the step to show (default: the last one logged)")
    sh.add_argument("-n", type=int, default=None, help="at most this many completions (default: all of the step's)")
    sh.set_defaults(fn=cmd_show)


def _score_parser(add: AddCommand) -> None:
    """`raygrpo score CONFIG FILE.jsonl [overrides] [--out SCORES.jsonl]`."""
    sc = add("score", help="score hand-written completions with the config's reward functions (no run starts)",
             description="Scores each row of FILE.jsonl (a JSON object per line: completion, prompt and the "
             "dataset's fields) with CONFIG's reward functions, every kind, as training would; no engine or learner "
             "starts. Prints per row each function's score and, for code_tests, every test's outcome; --out writes "
             "one row per input row, in order: reward, rewards (name -> score or null), tests (code only).")
    sc.add_argument("config", help="YAML config whose reward section is used, e.g. examples/cpu_demo.yaml")
    sc.add_argument("file", metavar="FILE.jsonl", help="rows to score")
    sc.add_argument("overrides", nargs="*", help=_overrides_help())
    sc.add_argument("--out", default=None, metavar="SCORES.jsonl", help="write the scores, one row per input row")
    sc.set_defaults(fn=cmd_score)


def _export_parser(add: AddCommand) -> None:
    """`raygrpo export CHECKPOINT OUT_DIR [--model-path P] [--overwrite]`."""
    e = add("export", help="write a checkpoint as a plain HF model directory",
            description="Consolidate a checkpoint's (ZeRO-sharded) weights into OUT_DIR with the "
            "tokenizer: transformers' from_pretrained and vLLM load it. Needs no running actors.")
    e.add_argument("checkpoint", help="a checkpoint directory, e.g. runs/x/checkpoints/step-00000010")
    e.add_argument("out_dir", help="where to write the HF model (config.json, model.safetensors, tokenizer); "
                   "must be empty or new")
    e.add_argument("--model-path", default=None,
                   help="the original model directory (default: the checkpoint's own config; LoRA runs: "
                   "the base model they trained from, where its weights come from)")
    e.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty OUT_DIR: once the new export is complete, what was there is moved "
                   "aside to OUT_DIR.replaced-<time> (nothing is deleted). A run dir or the checkpoint itself is "
                   "never a target")
    e.set_defaults(fn=cmd_export)


def _plot_parser(add: AddCommand) -> None:
    """`raygrpo plot RUN_DIR`."""
    pl = add("plot", help="PNG curves of a run: reward, KL, step time split",
             description="Reads RUN_DIR/metrics.jsonl; writes reward.png, kl.png, step_time.png there.")
    pl.add_argument("run_dir", help="a run directory written by `raygrpo train` (holds metrics.jsonl)")
    pl.set_defaults(fn=cmd_plot)


def _demo_parser(add: AddCommand) -> None:
    """`raygrpo demo [--recipe R] [overrides]`: the recipe, its steps, seed and warm start."""
    d = add("demo", help="build a small model and show GRPO learning on CPU (2-digit addition, or a --recipe)",
            description="Builds (or reuses) a small Qwen2 model offline, warm-starts it briefly on the task "
            "format, then trains it with GRPO through the full system (Ray, vLLM, DeepSpeed, reference, "
            "a verified weight sync every step) and prints held-out accuracy before and after.")
    d.add_argument("--recipe", default="addition", choices=DEMO_RECIPES,
                   help="the training mode shown: addition (default: full fine-tuning, sync schedule), lora (only the "
                   "adapter travels to vLLM), async (trainer.mode=async), pipeline (trainer.mode=pipeline: the engine never "
                   "stops, updates land mid-request), chat (BPE chat model, conversational word "
                   "problems, gsm8k reward), tools (multi-turn with the calculator environment), reward_model (scored by a "
                   "reward model alone, built from the warm start on its own samples), smollm2 (a real pretrained model, "
                   "SmolLM2-135M-Instruct converted from PyPI, no warm start), code (SmolLM2 writes small Python functions "
                   "scored by code_tests in the sandbox)")
    d.add_argument("--run-dir", default=None, help="default: runs/demo, or runs/demo-RECIPE")
    d.add_argument("--steps", type=_positive_int, default=None, metavar="N",
                   help="GRPO steps, at least 1 (default: the demo config's)")
    d.add_argument("--cache-dir", default=".cache/demo", help="where the base model and warm start are cached")
    d.add_argument("--seed", type=_seed, default=None,
                   help="seed of the warm start and of GRPO, 0 to 2**32-1 (sets trainer.seed; default: the demo config's)")
    d.add_argument("--warm-start-steps", type=_positive_int, default=None, metavar="N",
                   help="at most N supervised warm-start steps (default: the recipe's cap; it stops earlier at its "
                   "target accuracy). Fewer give a weaker start: for a quick look, not for a figure")
    d.add_argument("--reward-model-steps", type=_positive_int, default=None, metavar="N",
                   help="--recipe reward_model: its reward model's Bradley-Terry steps (default: the recipe's). Fewer "
                   "give a weaker reward model: for a quick look, not for a figure")
    d.add_argument("--warm-start-threads", type=int, default=1, choices=range(1, 65), metavar="N",
                   help="torch threads in the warm start (default 1; another count gives another floating-point "
                   "trajectory, as another CPU does)")
    d.add_argument("overrides", nargs="*", help=_overrides_help())
    d.set_defaults(fn=cmd_demo)


def _bench_parser(add: AddCommand) -> None:
    """`raygrpo bench [overrides]`: the setting, the model's size, the parts and each part's sizes."""
    b = add("bench", help="measure throughput, sync cost, schedules, ZeRO stages; compare with TRL",
            description="Measures, in one run on this machine: (1) rollout tokens/s through a RolloutWorker "
            "Ray actor vs the same vLLM engine called directly, (2) a full weight update (learner -> vLLM, "
            "gloo) vs a raw gloo broadcast of the same bytes, and sync's share of a step, (3) sync vs async "
            "schedule step time, (4) learner tokens/s under ZeRO-2 and ZeRO-3, (5) TRL's GRPOTrainer on the "
            "same task/model/batch/steps/lr (installed on demand into .venv-bench), (6) LoRA: sync bytes and seconds "
            "adapter vs merged vs full, optimizer state LoRA vs full. Prints a table and "
            "writes it as JSON with the machine's details (see docs/benchmarks.md). --setting long: "
            "the regime the design is for (a ~31.5M-parameter random model, every completion 128 "
            "tokens), where generation dominates a step.")
    b.add_argument("overrides", nargs="*", help="dotted config overrides on the bench's pinned training settings "
                   "(cluster/bench/report.py BENCH_SETTINGS, + LONG_SETTINGS for --setting long), e.g. algo.beta=0 "
                   "learner.lr=5e-5")
    b.add_argument("--setting", choices=("default", "long"), default="default",
                   help="default: the CPU demo's task and sizes, 8 new tokens, a warm-started model. long: "
                   "long completions where generation dominates: hidden 512 x 8 layers (~31.5M parameters), random "
                   "weights (no warm start), 128 new tokens per completion with rollout.min_new_tokens=128 (vLLM "
                   "min_tokens, TRL min_new_tokens: no completion stops early), 4 prompts x G=8; runs only parts "
                   "schedule,trl unless --parts names others (parts 1, 2, 4, 6 would take many minutes there)")
    b.add_argument("--hidden-size", type=int, default=None,
                   help="tiny Qwen2 hidden size (head_dim 32); default 128 (~1M params), --setting long: 512")
    b.add_argument("--num-layers", type=int, default=None, help="tiny Qwen2 layers; default 4, --setting long: 8")
    b.add_argument("--model", nargs="?", const=str(SMOLLM2_FIXTURE), default="", metavar="PATH",
                   help="a real model (an HF directory; bare --model: SmolLM2-135M-Instruct, built into "
                   ".cache/tests when missing): raygrpo's sync and async schedules against TRL's GRPOTrainer on "
                   "chat word problems, 4 prompts x G=4 x exactly 32 new tokens on both sides, per-phase table, "
                   "the ratio raygrpo-best / TRL-best with the phase that bounds it, the learner's memory; parts "
                   "schedule,trl unless --parts names others. Put overrides before --model")
    b.add_argument("--steps", type=int, default=None, help="training steps of the sync/async/TRL runs (the first is "
                   "warm-up); default 5, with --model 3")
    b.add_argument("--out", default="runs/bench/bench.json", help="where the JSON goes (work files beside it)")
    b.add_argument("--skip-trl", action="store_true", help="leave out part 5 (no .venv-bench, no TRL install)")
    b.add_argument("--parts", default="", help="comma list of rollout,learner,sync,schedule,trl,lora,rewards (default: all; "
                   "crosshost, only when named: the update across two nodes of a joined cluster vs a raw gloo broadcast; "
                   "pipeline, only when named: trainer.mode sync vs async vs pipeline on long-tailed completions, tokens/s, "
                   "engine idle fraction and step time, against issue 40's goals; code, only when named: code rewards' "
                   "programs/s through the sandbox at 1, 2, 4 workers on the code recipe's data and 1 s programs (alone: no Ray); "
                   "--setting long: schedule,trl)")
    b.add_argument("--lora-rank", type=int, default=16, help="LoRA rank of part 6 (adapter vs merged vs full sync)")
    b.add_argument("--cache-dir", default=".cache/bench", help="where the tiny models and warm starts are cached")
    b.add_argument("--warm-start-steps", type=int, default=None,
                   help="supervised warm-start steps (cached; 0: none); default 900, --setting long: 0 (always)")
    b.add_argument("--gen-prompts", type=int, default=32, help="prompts per rollout call in part 1")
    b.add_argument("--gen-tokens", type=int, default=32, help="max new tokens per completion in part 1")
    b.add_argument("--gen-repeats", type=int, default=3, help="timed rollout calls per path in part 1 (after warm-up)")
    b.add_argument("--learner-ranks", type=int, default=2, help="DeepSpeed ranks for parts 2 and 4")
    b.add_argument("--learner-steps", type=int, default=3, help="timed train steps per ZeRO stage (after warm-up)")
    b.add_argument("--sync-repeats", type=int, default=5, help="timed full weight updates / raw broadcasts")
    b.add_argument("--trl-threads", default=None, help="torch threads of the TRL process, a comma list runs it once per "
                   "value (0: all CPUs; default 1,0: one thread, as each raygrpo actor has, then every CPU; with "
                   "--model 0)")
    b.add_argument("--peak-tflops", type=float, default=None, help="the device's peak TFLOP/s, to report learner MFU")
    b.add_argument("--timeout", type=float, default=900, help="seconds any single wait may take")
    b.add_argument("--calibrate", nargs="?", const="runs/calibrate/profile.json", default=None, metavar="FILE",
                   help="instead of the parts: measure what `raygrpo plan --cluster local` needs with the config's model "
                   "(generation tokens/s by batch and length, learner tokens/s and memory by micro-batch, sync bytes/s, "
                   "reward cost; a few minutes) and write the profile to FILE (default runs/calibrate/profile.json)")
    b.set_defaults(fn=cmd_bench)


def _plan_parser(add: AddCommand) -> None:
    """`raygrpo plan CONFIG --cluster C`: the cluster, the profile, the workload's lengths, the output."""
    pn = add("plan", help="predict a run's step time and memory on a cluster, and recommend its placement",
             description="Predicts, before anything starts, the step time by phase and the memory per device of "
             "CONFIG on a cluster, for the config as given and for the placement it recommends (engines x TP, "
             "learner ranks, ZeRO stage, micro-batch, schedule), with every candidate it weighed and why the winner "
             "won; refuses, with the reason, a cluster on which nothing fits (exit 2). Method: docs/plan.md.")
    pn.add_argument("config", help="YAML config (model.path: a model directory, or a published model's name)")
    pn.add_argument("overrides", nargs="*", help=_overrides_help())
    pn.add_argument("--cluster", required=True, help="local (this machine, from its calibration: raygrpo bench "
                    "--calibrate), NODESxDEVICESxNAME (e.g. 2x8xH100), or a YAML of nodes (docs/plan.md)")
    pn.add_argument("--profile", default=None, metavar="FILE", help="a calibration profile (default for local: "
                    "runs/calibrate/profile.json); with a GPU spec its measured overheads replace the assumed ones")
    pn.add_argument("--efficiency", type=float, default=None, help="share of the devices' published peak FLOP/s "
                    "reached (default 0.4)")
    pn.add_argument("--mean-new-tokens", type=float, default=None, help="mean completion length (default: half of "
                    "rollout.max_new_tokens, all of it with rollout.min_new_tokens = max_new_tokens)")
    pn.add_argument("--prompt-tokens", type=int, default=None, help="mean prompt length (default: from the data)")
    pn.add_argument("--json", action="store_true", help="print one JSON object: as_given, recommended (+ overrides)")
    pn.add_argument("--write", default=None, metavar="FILE", help="write the config with the recommended overrides")
    pn.set_defaults(fn=cmd_plan)


# One builder per command, in the order `raygrpo --help` lists them: a new command is its builder and one line here.
COMMAND_PARSERS: tuple[Callable[[AddCommand], None], ...] = (
    _train_parser,
    _data_parser,
    _submit_parser,
    _show_parser,
    _score_parser,
    _export_parser,
    _plot_parser,
    _demo_parser,
    _bench_parser,
    _plan_parser,
)


def build_parser() -> argparse.ArgumentParser:
    """`raygrpo`'s parser: every command with the common options (--log-level)."""
    p = argparse.ArgumentParser(prog="raygrpo", description="GRPO training on Ray: vLLM rollouts, DeepSpeed-ZeRO learner.")
    sub = p.add_subparsers(dest="command", required=True)
    common = _common_options()

    def add(name: str, **kw) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], **kw)

    for add_command in COMMAND_PARSERS:
        add_command(add)
    return p


def main(argv: list[str] | None = None) -> int:
    from cluster.config import ConfigError
    from cluster.data.dataset import DataError
    from cluster.launch.auth import ClusterAuthError
    from cluster.launch.submit import SubmitError
    from cluster.run.health import TrainingHalted
    from cluster.run.rundir import RunDirError
    from cluster.run.stopping import Interrupted, RunStopped

    parser = build_parser()
    # overrides may come after options too (`submit cfg.yaml --address URL a.b=c`)
    args, extra = parser.parse_known_args(argv)
    bad = [x for x in extra if "=" not in x or x.startswith("-")]
    if bad or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(bad or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        setup_driver(console_level(args.log_level))
    except ValueError as e:  # RAYGRPO_LOG_LEVEL set to something else than a level
        _report(e, "error")
        return 2
    try:
        return args.fn(args)
    except (ConfigError, DataError, RunDirError, ClusterAuthError, SubmitError, FileNotFoundError, FileExistsError) as e:
        _report(e, "error")
        return 2
    except OSError as e:  # e.g. a full disk (learner.checkpoint.SaveError names the path and the free space)
        _report(e, "error")
        return 1
    except RunStopped as e:
        print(f"raygrpo: {e}", file=sys.stderr)
        return 128 + e.signum
    except TrainingHalted as e:
        _report(e, "run halted")
        return 3
    except KeyboardInterrupt as e:
        what = f"stopped by {e}" if isinstance(e, Interrupted) else "interrupted"
        print(f"raygrpo: {what} before a step boundary; the last complete checkpoint is kept, the same command "
              "resumes from it", file=sys.stderr)
        return 128 + (e.signum if isinstance(e, Interrupted) else 2)
    except Exception as e:  # a run that failed: say what, keep what was written
        _report(e, "run failed")
        return 1


def _report(e: BaseException, prefix: str) -> None:
    if os.environ.get("RAYGRPO_DEBUG"):
        import traceback

        traceback.print_exc()
    msg = str(e)
    # Ray wraps an actor's exception in RayTaskError: show the original message, not the wrapper's dump
    cause = getattr(e, "cause", None)
    if cause is not None and str(cause):
        msg = f"{type(cause).__name__}: {cause}"
    print(f"raygrpo: {prefix}: {msg}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
