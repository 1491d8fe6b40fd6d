"""`raygrpo bench`: run the parts, print the table, write the JSON."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from cluster.bench import code as code_part
from cluster.bench import cross_host, pipeline_summary
from cluster.bench import pipeline as pipeline_part
from cluster.bench import rewards as reward_part
from cluster.bench.calibrate import run_calibrate
from cluster.bench.learner_sync import (
    bench_learner_and_sync,
    bench_raw_broadcast,
    fixed_batch,
)
from cluster.bench.lora import bench_lora
from cluster.bench.model_bench import memory_line, model_dir, phase_rows, report_lines, verdict, write_prompts
from cluster.bench.report import (
    DEFAULT_STEPS,
    DEFAULT_TRL_THREADS,
    MODEL_STEPS,
    MODEL_TRL_THREADS,
    BenchSetting,
    load_average,
    machine_info,
    model_spec,
    progress,
    ratio,
    resolve_setting,
    write_json,
)
from cluster.bench.rollout import bench_rollout, current_niceness, direct_vllm_main
from cluster.bench.schedule import bench_schedule, heldout_accuracy, heldout_examples
from cluster.bench.table import fmt_value, format_table, table_rows
from cluster.bench.trl import bench_trl, parse_threads, trl_main, trl_settings
from cluster.config import RunConfig, load_config
from cluster.data.dataset import load_splits
from cluster.launch.ray_cluster import start_ray
from cluster.models.tinymodel import build_tiny_model, num_parameters
from cluster.models.warmstart import WarmStartSpec, warm_start


def run_bench(args) -> int:
    """`raygrpo bench`. A part that fails still leaves the parts before it in the JSON (with `error`)."""
    if getattr(args, "calibrate", None):  # the profile `raygrpo plan --cluster local` reads, not the parts
        return run_calibrate(args)
    if [p.strip() for p in (args.parts or "").split(",") if p.strip()] == ["code"]:  # no Ray, no model
        return _run_code_part(args)
    res: dict = {}
    try:
        return _run_bench(args, res)
    except BaseException as e:
        if res:
            res["error"] = f"{type(e).__name__}: {e}"
            res["load_average_end"] = load_average()
            write_json(args.out, res)
            print(f"raygrpo bench: partial results written to {args.out}", file=sys.stderr)
        raise


def _run_code_part(args) -> int:
    res = {"machine": machine_info(), "load_average_start": load_average(), "command": " ".join(sys.argv)}
    code_part.run_part(res, progress)
    res["load_average_end"] = load_average()
    write_json(args.out, res)
    progress(f"wrote {args.out}")
    return 0


@dataclasses.dataclass
class BenchRun:
    """What the parts of one `raygrpo bench` share: the flags, the setting, the model, the config, the results."""

    args: argparse.Namespace
    res: dict  # the results so far: written as the JSON, also when a part fails
    setting: BenchSetting
    steps: int  # of the sync/async/TRL runs
    trl_threads: str
    out_path: Path
    workdir: Path
    cache: Path
    timeout_s: float
    t_start: float  # time.perf_counter() at the start: the JSON's wall_seconds
    base: Path | None = None  # the model as built (or --model's)
    warm: Path | None = None  # the model the runs train: the warm start, or base
    n_params: int | None = None
    user: list = dataclasses.field(default_factory=list)  # the user's overrides (+ --model's prompts)
    train_overrides: list = dataclasses.field(default_factory=list)
    cfg: RunConfig | None = None  # the training config of parts 3 and 5 (and the shapes of 1, 2, 4)

    @property
    def real(self) -> bool:
        return self.setting.name == "model"

    @property
    def parts(self) -> set[str]:
        return set(self.setting.parts)


def _run_bench(args, res: dict) -> int:
    setting = resolve_setting(args.setting, args.hidden_size, args.num_layers, args.warm_start_steps, args.parts,
                              args.model)  # before the heavy imports: a wrong flag fails fast
    import ray

    run = _start(args, res, setting)
    _build_model(run)
    _training_config(run)
    _parts_on_ray(run, ray)
    _heldout(run)
    if "trl" in run.parts:
        _trl_part(run)
    _write_and_print(run)
    return 0


def _start(args, res: dict, setting: BenchSetting) -> BenchRun:
    real = setting.name == "model"
    # Absolute before anything crosses into another process (TRL's runs from the project directory: a
    # relative warm-start path there was taken for a hub repo id when the bench ran from elsewhere)
    out_path = Path(args.out).resolve()
    run = BenchRun(args=args, res=res, setting=setting,
                   steps=args.steps if args.steps is not None else (MODEL_STEPS if real else DEFAULT_STEPS),
                   trl_threads=args.trl_threads if args.trl_threads is not None else (
                       MODEL_TRL_THREADS if real else DEFAULT_TRL_THREADS),
                   out_path=out_path, workdir=out_path.parent / "work", cache=Path(args.cache_dir).resolve(),
                   timeout_s=float(getattr(args, "timeout", 900)), t_start=time.perf_counter())
    run.workdir.mkdir(parents=True, exist_ok=True)
    res.update({"machine": machine_info(), "load_average_start": load_average(), "command": " ".join(sys.argv),
                "setting": setting.describe()})
    progress(f"load average at start: {res['load_average_start']} on {res['machine']['cpu_count']} CPUs")
    return run


def _build_model(run: BenchRun) -> None:
    """The model: --model's real one, or the tiny random one of the setting's shape."""
    res = run.res
    if run.real:
        run.base = run.warm = model_dir(run.args.model)
        run.n_params = num_parameters(run.base) if (run.base / "model.safetensors").exists() else None
        hf = json.loads((run.base / "config.json").read_text())
        res["model"] = {"path": str(run.base), "parameters": run.n_params, "hidden_size": hf.get("hidden_size"),
                        "num_layers": hf.get("num_hidden_layers"), "model_type": hf.get("model_type")}
    else:
        spec = model_spec(run.setting.hidden_size, run.setting.num_layers)
        run.base = build_tiny_model(run.cache / f"base-h{spec.hidden_size}-l{spec.num_layers}", spec)
        run.warm = run.base  # replaced by the warm start below unless --warm-start-steps 0 (or --setting long)
        run.n_params = num_parameters(run.base)
        res["model"] = {"path": str(run.base), "parameters": run.n_params, **dataclasses.asdict(spec)}
    progress(f"model: {run.base} ({(run.n_params or 0) / 1e6:.2f}M parameters)")


def _training_config(run: BenchRun) -> None:
    """The warm start (when a part needs one) and the training config: BENCH_SETTINGS (+ LONG_SETTINGS for
    --setting long) + the user's overrides."""
    setting, res = run.setting, run.res
    run.user = list(run.args.overrides or [])
    if run.real:  # the prompts both sides train on, before the user's overrides (which may name others)
        run.user = [f"data.train={write_prompts(run.cache)}", *run.user]
    cfg0 = load_config(None, [*setting.overrides, f"model.path={run.base}", *run.user])
    if not run.real and setting.warm_start_steps > 0 and run.parts - {"rewards", "crosshost", "pipeline", "code"}:  # none needs one
        t = time.perf_counter()
        train_set, _ = load_splits(cfg0.data.train, cfg0.data.eval, cfg0.data.num_eval, cfg0.data.task_digits,
                                   cfg0.trainer.seed)
        ws = WarmStartSpec(steps=setting.warm_start_steps)
        run.warm = warm_start(run.base, run.cache / f"warm-h{setting.hidden_size}-l{setting.num_layers}-{ws.steps}",
                              train_set, ws)
        res["model"]["warm_start"] = {"path": str(run.warm), **dataclasses.asdict(ws), "seconds": time.perf_counter() - t}
        progress(f"warm start: {run.warm} ({time.perf_counter() - t:.0f}s; cached by spec)")
    run.train_overrides = [*setting.overrides, f"model.path={run.warm}", f"trainer.steps={run.steps}", *run.user]
    run.cfg = load_config(None, run.train_overrides)
    res["config"] = {"overrides": run.train_overrides, "resolved": run.cfg.to_dict()}


def _parts_on_ray(run: BenchRun, ray) -> None:
    """Every part that needs Ray, in order; Ray is down when this returns (or raises)."""
    res, parts, cfg = run.res, run.parts, run.cfg
    progress(f"setting {run.setting.name}: parts {','.join(p for p in run.setting.parts)}")
    start_ray(cfg.ray.address, cfg.ray.num_cpus)
    # Ray runs its workers at a raised niceness (15 by default); the baselines get the same
    res["ray_worker_niceness"] = ray.get(ray.remote(num_cpus=0)(current_niceness).remote(), timeout=run.timeout_s)
    res["driver_niceness"] = current_niceness()
    rollout_actor = None
    try:
        if "crosshost" in parts:  # the weight update across two nodes vs a raw gloo broadcast on the same link
            _crosshost_part(run, ray)
        rollouts = None
        if parts & {"rollout", "learner", "sync", "lora"}:
            rollout_actor, rollouts = _rollout_part(run, ray)
        if rollouts is not None and parts & {"learner", "sync", "lora"}:
            _learner_sync_lora_parts(run, ray, rollouts, rollout_actor)
        if rollout_actor is not None:
            ray.kill(rollout_actor)
            rollout_actor = None
        if "sync" in parts and res.get("sync", {}).get("backend") == "gloo":  # the raw baseline is gloo only
            res["raw_broadcast"] = bench_raw_broadcast(ray, res["sync"]["bytes"], run.args.sync_repeats, run.timeout_s)
            res["sync"]["vs_raw"] = ratio(res["sync"]["seconds"], res["raw_broadcast"]["seconds"])
        if parts & {"schedule", "trl"}:
            _schedule_part(run)
        # 7. reward-model scoring throughput, a remote verifier's overhead per batch
        if "rewards" in parts:
            train_set, _ = load_splits(cfg.data.train, "", 0, cfg.data.task_digits, cfg.trainer.seed)
            reward_part.run_part(ray, res, run.setting, cfg, train_set, max(3, run.args.gen_repeats), run.workdir,
                                 run.timeout_s, progress)
        # 8. sync vs async vs pipeline on long-tailed completions (its own random model and settings)
        if "pipeline" in parts:
            res["pipeline"] = pipeline_part.run_part(run.cache, run.setting.hidden_size, run.setting.num_layers,
                                                     run.steps, run.user, run.out_path.parent)
        # 9. code rewards' programs/s through the sandbox (named beside other parts; alone it starts no Ray)
        if "code" in parts:
            code_part.run_part(res, progress)
    finally:
        if rollout_actor is not None:
            ray.kill(rollout_actor)
        ray.shutdown()


def _crosshost_part(run: BenchRun, ray) -> None:
    ch = run.res["cross_host"] = cross_host.bench_cross_host(ray, str(run.base), run.cfg, run.args.sync_repeats,
                                                             run.timeout_s)
    progress(f"crosshost: update {fmt_value(ch['sync']['seconds'])} s, raw broadcast "
             f"{fmt_value(ch['raw_broadcast']['seconds'])} s for {ch['sync']['bytes'] / 2**20:.2f} MiB "
             f"({ch['host_a']} -> {ch['host_b']}): x{fmt_value(ch['vs_raw'])}")


def _rollout_part(run: BenchRun, ray) -> tuple:
    """1. rollout throughput (random base model: completions mostly run to max tokens). Returns the engine
    actor (parts 2, 4 and 6 sync to it) and its rollouts (their batch)."""
    args, cfg = run.args, run.cfg
    rcfg = dataclasses.replace(cfg.rollout, max_model_len=max(cfg.rollout.max_model_len, args.gen_tokens + 32))
    train_set, _ = load_splits(cfg.data.train, "", 0, cfg.data.task_digits, cfg.trainer.seed)
    prompts = [e.prompt for e in train_set[:args.gen_prompts]]
    if any(not isinstance(p, str) for p in prompts):  # chat rows (--model): the text its template makes
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(run.base))
        prompts = [p if isinstance(p, str) else tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
                   for p in prompts]
    run.res["rollout"], rollout_actor, rollouts = bench_rollout(
        ray, str(run.base), rcfg, prompts, cfg.trainer.group_size, args.gen_tokens, args.gen_repeats, run.workdir,
        run.timeout_s, run.res["ray_worker_niceness"])
    ro = run.res["rollout"]
    progress(f"rollout: direct {fmt_value(ro['direct']['tokens_per_s'])} tok/s, RolloutWorker no Ray "
             f"{fmt_value(ro['wrapper']['tokens_per_s'])}, via Ray {fmt_value(ro['actor']['tokens_per_s'])} "
             f"(ratio {fmt_value(ro['actor_vs_direct'])}, same tokens: {ro['same_tokens']})")
    return rollout_actor, rollouts


def _learner_sync_lora_parts(run: BenchRun, ray, rollouts, rollout_actor) -> None:
    """4. learner ZeRO-2 / ZeRO-3 on the rollouts just generated; 2. weight sync with the same ranks; 6. LoRA
    sync and optimizer memory vs full fine-tuning."""
    from transformers import AutoTokenizer

    args, cfg, res, parts = run.args, run.cfg, run.res, run.parts
    pad = AutoTokenizer.from_pretrained(str(run.base)).pad_token_id or 0
    batch = fixed_batch(rollouts, pad, with_ref=cfg.algo.beta > 0)
    ranks = args.learner_ranks
    while len(batch) % ranks:
        ranks -= 1
    res["learner"] = {}
    for stage in (2, 3) if parts & {"learner", "sync"} else ():
        lr_res, sy = bench_learner_and_sync(
            ray, str(run.base), cfg, stage, ranks, batch, args.learner_steps if "learner" in parts else 0,
            args.sync_repeats if "sync" in parts else 0, rollout_actor, run.n_params, args.peak_tflops, run.timeout_s)
        if lr_res:
            res["learner"][f"ZeRO-{stage}"] = lr_res
            progress(f"learner ZeRO-{stage}: {fmt_value(lr_res['tokens_per_s'])} tokens/s")
        if sy:
            res["sync" if stage == 2 else "sync_zero3"] = sy
            progress(f"sync ZeRO-{stage}: {fmt_value(sy['seconds'])} s for {sy['bytes'] / 2**20:.2f} MiB")
    if not res["learner"]:
        res.pop("learner")
    if "lora" in parts:
        res["lora"] = bench_lora(ray, str(run.base), cfg, batch, args.lora_rank, args.sync_repeats, run.timeout_s)


def _schedule_part(run: BenchRun) -> None:
    """3. sync vs async schedule (the sync run is also raygrpo's side of part 5); --model: the learner's memory."""
    res = run.res
    res["schedules"] = {}
    for mode in ("sync", "async") if "schedule" in run.parts else ("sync",):
        if run.real and mode == "sync":  # the learner's memory (kept in a partial JSON too)
            res["memory"] = {}
        summary, rows = bench_schedule(run.train_overrides, mode, run.out_path.parent / f"train-{mode}",
                                       res["memory"] if run.real and mode == "sync" else None)
        res["schedules"][mode] = {**summary, "rows": rows}
        progress(f"schedule {mode}: {fmt_value(summary.get('step_s'))} s/step")
        if run.real and mode == "sync":
            progress(memory_line(res["memory"]))


def _heldout(run: BenchRun) -> None:
    """Held-out greedy accuracy, one procedure for every model (after Ray is down: nothing runs beside it)."""
    cfg = run.cfg
    sync_run = run.res.get("schedules", {}).get("sync")
    if sync_run and sync_run.get("hf_model") and cfg.data.num_eval > 0:  # --setting long: none (random weights)
        data = dataclasses.asdict(cfg.data)
        progress(f"held-out accuracy: the starting model and raygrpo's after {run.steps} steps (HF greedy)")
        run.res["heldout"] = {"prompts": len(heldout_examples(data, cfg.trainer.seed)),
                              "before": heldout_accuracy(str(run.warm), data, cfg.trainer.seed, cfg.rollout.max_new_tokens),
                              "raygrpo_after": heldout_accuracy(sync_run["hf_model"], data, cfg.trainer.seed,
                                                                cfg.rollout.max_new_tokens)}


def _trl_part(run: BenchRun) -> None:
    """5. TRL (its own environment, after Ray is down so nothing else runs beside it), once per thread count."""
    res = run.res
    for i, threads in enumerate(parse_threads(run.trl_threads)):
        key = "trl" if i == 0 else f"trl_{threads}threads"
        res[key] = bench_trl(trl_settings(run.cfg, str(run.warm), threads), run.workdir, run.args.skip_trl,
                             run.timeout_s, res.get("ray_worker_niceness"))
        if res[key].get("status") == "ok":
            if i == 0 and "heldout" in res:
                res["heldout"]["trl_after"] = res[key].get("heldout_accuracy_after")
            progress(f"TRL ({threads} thread(s)): {fmt_value(res[key].get('step_s'))} s/step, reward "
                     f"{fmt_value(res[key].get('reward_first'))} -> {fmt_value(res[key].get('reward_last'))}")
        else:
            progress(f"TRL: {res[key].get('status')}: {res[key].get('message')}")
            break


def _write_and_print(run: BenchRun) -> None:
    """The table and the per-phase figures into the results, the JSON written, the report printed."""
    res = run.res
    res["load_average_end"] = load_average()
    res["wall_seconds"] = time.perf_counter() - run.t_start
    rows = table_rows(res)
    res["table"] = [list(r) for r in rows]
    if "pipeline" in res:
        res["pipeline"]["lines"] = pipeline_summary.report_lines(res["pipeline"])
    phases = phase_rows(res)
    if phases:
        res["phases"], res["verdict"] = phases, verdict(phases)
    write_json(run.out_path, res)
    print()
    print(f"raygrpo bench: {res['model'].get('parameters') or 0:,} parameters, {res['machine']['cpu_count']} CPUs "
          f"({res['machine']['cpu_model']}), load average {res['load_average_start']} -> {res['load_average_end']}, "
          f"{res['wall_seconds'] / 60:.1f} min")
    print(format_table(rows))
    for line in report_lines(res):
        print(line)
    for line in res.get("pipeline", {}).get("lines", []):
        print(line)
    print(f"\nwritten: {run.out_path}")


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "direct-vllm":
        return direct_vllm_main(argv[1])
    if len(argv) >= 3 and argv[0] == "trl":
        return trl_main(argv[1], argv[2])
    print("usage: python -m cluster.bench direct-vllm SPEC | trl SPEC OUT   (internal; run `raygrpo bench`)",
          file=sys.stderr)
    return 2

