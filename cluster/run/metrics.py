"""Where the numbers go: a progress bar, `metrics.jsonl`, TensorBoard, optional wandb, PNG plots."""
from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from pathlib import Path

import yaml
from tqdm import tqdm

from actors.runtime.atomic_file import replace_text
from cluster.run import completions
from cluster.run.completions import COMPLETIONS_FILE
from cluster.run.eta import EtaEstimator, format_duration
from cluster.run.jsonl import read_jsonl, torn_note
from learner.checkpoint import naming_save_errors

# What the learner reports for a step that a step's line carries.
# train_threads_max: the most torch threads a rank trained with (more than its share where the
# collecting side lent its idle cores, cluster/launch/thread_budget.py).
# learner_peak_bytes: the most memory a rank's model took (learner/peak_memory.py; `raygrpo plan` predicts it).
LEARNER_KEYS = ("loss", "pg_loss", "kl", "clip_frac", "entropy", "grad_norm", "lr", "ratio_mean", "tis_weight_mean",
                "logprob_diff_mean", "logprob_diff_max", "train_threads_max", "learner_peak_bytes")
# Multi-turn rollouts (rollout.env; NaN in single-turn runs): assistant turns and "tool" messages per
# trajectory, environment failures (each ended its trajectory), trajectories whose environment messages did
# not fit in rollout.max_model_len (each ended there), seconds the engines waited on environments,
# environment tokens per trajectory (in the context, out of the loss).
MULTITURN_KEYS = ("turns_mean", "tool_calls_mean", "env_errors", "env_overflows", "env_s", "env_tokens_mean")
# Completion lengths in model tokens over every scored completion of the step (TRL's names); clipped:
# the share cut at rollout.max_new_tokens. The turn_* ones: per assistant turn of multi-turn rollouts.
COMPLETION_KEYS = tuple(f"completions/{turn}{name}" for turn in ("", "turn_")
                        for name in ("mean_length", "min_length", "max_length", "clipped_ratio"))
# Throughput as users read it (README, "Metrics"): generation tokens per second of generation time
# (perf/tokens_per_s, which the progress line shows), trained tokens (prompt + completion) per second of
# training time, the share of the step's wall time the engines did not generate. perf/mfu (model FLOPs
# utilisation of the learner) only with metrics.peak_tflops set: a run's extra key, not one of these.
PERF_KEYS = ("perf/tokens_per_s", "perf/train_tokens_per_s", "perf/engine_idle_frac")
MFU_KEY = "perf/mfu"
# Per-token policy versions (every mode): how many versions behind the weights being trained each token's
# sampler was, over the batch's tokens; how many versions one sequence's tokens span (pipeline: an update can
# land mid-request). trainer.mode=pipeline only (NaN otherwise): groups dropped for trainer.max_staleness
# (their prompts generated again); each engine's share of wall time stepping requests, its tokens per second
# of wall time, the groups in flight over all engines, an engine's seconds paused for weight updates; on the
# first step after a resume, the groups in flight at that checkpoint, generated again (0 on the others).
VERSION_KEYS = ("staleness/token_mean", "staleness/token_max", "versions_per_sequence_mean")
PIPELINE_KEYS = ("stale_groups", "pipeline/engine_busy_frac", "pipeline/engine_tokens_per_s", "pipeline/queue_depth",
                 "pipeline/pause_s", "pipeline/regenerated_on_resume")
# Every step's line carries exactly these keys (NaN when a value does not apply, e.g. kl at beta=0),
# and the run's per-reward-function keys rewards/<name>/<stat> (actors/rewards/scorer.py metric_keys).
# reward_unscorable: completions no reward function could score (a null), out of their group and the loss.
# reward: TRL's name for reward_mean, logged beside it (reward_std is the same name in both).
STEP_KEYS = (
    "step", "reward", "reward_mean", "reward_std", "reward_errors", "reward_unscorable", *LEARNER_KEYS,
    "gen_tokens", "gen_s", "reward_s", "ref_s", "train_s", "sync_s", "step_s", "weight_version", "staleness",
    "zero_var_groups", "skipped_prompts", "extra_prompts", "trained_groups", "rollout_restarts",
    "rollout/live_engines",  # engines that generated this step (fewer than rollout.num_workers after a lost host)
    "update_skipped",
    "sync_bytes", "sync_verified", "sync_verify_s", *COMPLETION_KEYS,
    *MULTITURN_KEYS, *PERF_KEYS, *VERSION_KEYS, *PIPELINE_KEYS,
)


def perf_metrics(gen_tokens: float, gen_s: float, step_s: float, train_tokens: int, train_s: float, *,
                 params: int | None = None, passes: int = 1, peak_tflops: float = 0.0, devices: int = 1) -> dict:
    """A step's perf/* metrics (NaN where a time is 0: nothing generated or trained). MFU as the bench
    counts it: 6 x parameters x processed tokens per optimisation pass (learner.mu), against
    peak_tflops per learner device; absent without peak_tflops or a parameter count."""
    def per_s(n, s):
        return n / s if s and s > 0 else float("nan")

    out = {"perf/tokens_per_s": per_s(gen_tokens, gen_s), "perf/train_tokens_per_s": per_s(train_tokens, train_s),
           "perf/engine_idle_frac": min(max(1.0 - gen_s / step_s, 0.0), 1.0) if step_s and step_s > 0 else float("nan")}
    if peak_tflops and params:
        out[MFU_KEY] = per_s(6.0 * params * train_tokens * passes, train_s) / (peak_tflops * 1e12 * devices)
    return out


# A checkpoint carries the metrics rows of the steps it covers (under this name): a resume restores from
# it a row the raw file lost (a torn last line, a write cut short by a full disk or a power loss).
CHECKPOINT_ROWS = "metrics.jsonl"


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN; null reads as "not applicable"
    return v


def shown(value, spec: str) -> str:
    """A number for the console as metrics.jsonl has it: a NaN (no value this step) is null there, and here too
    (issue 59: the console said "loss nan" where the row said null)."""
    return format(value, spec) if isinstance(value, (int, float)) and math.isfinite(value) else "null"


class MetricsLogger:
    """One JSON line per step (and per evaluation) + TensorBoard (+ wandb) + a progress display."""

    def __init__(self, run_dir: str | Path, total_steps: int, start_step: int = 0, *, tensorboard: bool = True,
                 wandb_init: dict | None = None, config: dict | None = None, show_staleness: bool = False,
                 show_kl: bool = True, extra_keys: tuple[str, ...] = (), carried_rows: list[dict] = (),
                 eval_every: int = 0, evaluates: bool = False, wandb_run=None):
        """wandb_init: wandb.init's keywords (project, name, entity, tags); None: no W&B.
        wandb_run: a W&B run to go on with instead (the one of the logger before a restart, `detach_wandb`).
        show_staleness: the progress line says how many weight versions behind each batch was (async).
        show_kl: the progress line shows the KL (not in a run without a KL term, algo.beta = 0).
        extra_keys: this run's keys beside STEP_KEYS (the per-reward-function ones).
        carried_rows: the rows the checkpoint a run resumes from carries (restored where the file lost them).
        eval_every, evaluates: the run's evaluation schedule (trainer.eval_every; it has held-out prompts),
        for the ETA (cluster/run/eta.py)."""
        self.run_dir = Path(run_dir)
        self.keys = (*STEP_KEYS, *extra_keys)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.total, self.start_step, self.t0 = total_steps, start_step, time.time()
        self.show_staleness, self.show_kl = show_staleness, show_kl
        self.eta = EtaEstimator(total_steps, eval_every, evaluates)
        for path, carried in ((self.path, carried_rows), (self.run_dir / COMPLETIONS_FILE, None)):
            torn = read_jsonl(path)[1]
            if torn:  # moved aside below with the rows of the steps redone
                print(torn_note(path, torn, "moving aside") + f" (to {path.name}.superseded)", flush=True)
            with naming_save_errors(path):  # completions.jsonl: several rows a step, none carried
                moved, restored = supersede_rows(path, start_step, carried)
            if moved:
                print(f"resuming at step {start_step}: moved {moved} row(s) of later steps (or cut short) from "
                      f"{path} to {path.name}.superseded (those steps are redone now)", flush=True)
            if restored:
                print(f"resuming at step {start_step}: restored {restored} row(s) that {path} had lost from the "
                      "checkpoint's copy", flush=True)
        self._tb = self._wandb = self._bar = None
        self._tb_dir = self.run_dir / "tensorboard"
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            _quiet_tensorboard_writer_threads()
            # Resuming: TensorBoard hides the earlier run's events of the steps redone now (the
            # ones supersede_rows moved aside; step 0's evaluation is redone too).
            purge = start_step + 1 if start_step > 0 else 0
            with naming_save_errors(self._tb_dir):  # it writes (and fails on a full disk) at once
                self._tb = SummaryWriter(str(self._tb_dir), purge_step=purge)
        if wandb_run is not None:
            self._wandb = wandb_run
        elif wandb_init is not None:
            self._wandb = start_wandb(wandb_init, self.run_dir, config or {})
        if sys.stderr.isatty():
            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def log_step(self, m: dict) -> None:
        unknown = m.keys() - set(self.keys)
        if unknown:  # one list of what a step reports: a new metric is declared in STEP_KEYS first
            raise ValueError(f"step metrics {sorted(unknown)} are not in cluster/run/metrics.py STEP_KEYS; add them there")
        row = {k: m.get(k, float("nan")) for k in self.keys}
        self._write({"kind": "train", **row})
        step = int(row["step"])
        if self._tb:
            with naming_save_errors(self._tb_dir):  # a failed write of its thread is raised here, with the path
                for k, v in row.items():
                    if isinstance(v, (int, float)) and k != "step" and math.isfinite(v):
                        self._tb.add_scalar(f"train/{k}", v, step)
                self._tb.flush()
        if self._wandb:
            self._wandb.log({f"train/{k}": v for k, v in row.items() if isinstance(v, (int, float))}, step=step)
        self.eta.step_done(step, time.monotonic(), row["step_s"])
        left = self.eta.remaining_s(step)
        summary = f"reward {shown(row['reward_mean'], '.3f')}  len {shown(row['completions/mean_length'], '.1f')}"
        if row["completions/clipped_ratio"] > 0:
            summary += f" (clipped {100 * row['completions/clipped_ratio']:.0f}%)"
        if self.show_staleness:
            summary += f"  stale {row['staleness']}"
        summary += f"  step {row['step_s']:.1f}s"
        if math.isfinite(row["pipeline/engine_busy_frac"]):  # trainer.mode=pipeline: the engines' side
            summary += (f"  engines busy {100 * row['pipeline/engine_busy_frac']:.0f}% queue {row['pipeline/queue_depth']}"
                        f" paused {row['pipeline/pause_s']:.2f}s")
        if math.isfinite(row["perf/tokens_per_s"]):
            summary += f"  gen {row['perf/tokens_per_s']:.0f} tok/s"
        if left is not None:
            summary += f"  eta {format_duration(left)}"
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix_str(summary)
        else:
            kl = f"  kl {row['kl']:.4f}" if self.show_kl and math.isfinite(row["kl"]) else ""
            print(f"step {step}/{self.total}  {summary}  loss {shown(row['loss'], '.4f')}{kl}", flush=True)

    def log_completions(self, step: int, rows: list[dict]) -> None:
        """A few of the step's completions (cluster/run/completions.py): completions.jsonl, a TensorBoard
        text summary, a W&B table."""
        if not rows:
            return
        with naming_save_errors(self.run_dir / COMPLETIONS_FILE):
            completions.write_rows(self.run_dir, step, rows)
        rows = [{"step": step, **r} for r in rows]
        if self._tb:
            with naming_save_errors(self._tb_dir):
                self._tb.add_text("completions", completions.markdown(rows), step)
        if self._wandb:
            import wandb as wb

            columns, data = completions.table(rows)
            self._wandb.log({"completions": wb.Table(columns=columns, data=data)}, step=step)

    def log_eval(self, step: int, m: dict) -> None:
        """An evaluation's row; its eval_s (seconds) is what the ETA expects each later evaluation to take."""
        if "eval_s" in m:
            self.eta.eval_done(m["eval_s"])
        self._write({"kind": "eval", "step": step, **m})
        if self._tb:
            with naming_save_errors(self._tb_dir):
                for k, v in m.items():
                    if isinstance(v, (int, float)):
                        self._tb.add_scalar(f"eval/{k}", v, step)
                self._tb.flush()
        if self._wandb:
            self._wandb.log({f"eval/{k}": v for k, v in m.items()}, step=step)
        text = "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in m.items() if k != "eval_s")
        took = f" ({m['eval_s']:.1f}s)" if "eval_s" in m else ""
        (self._bar.write if self._bar is not None else print)(f"eval @ step {step}{took}: {text}")

    def note(self, text: str) -> None:
        (self._bar.write if self._bar is not None else print)(text)

    def _write(self, row: dict) -> None:
        """The whole line in one write, then flushed to the disk: a crash leaves a row whole or
        (a power loss, a full disk) cut short, which a resume replaces from its checkpoint's copy."""
        data = (json.dumps({k: _jsonable(v) for k, v in row.items()}) + "\n").encode()
        with naming_save_errors(self.path):
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
            try:
                written = os.write(fd, data)
                while written < len(data):  # a regular file takes it at once; a short write is finished
                    written += os.write(fd, data[written:])
                os.fsync(fd)
            finally:
                os.close(fd)

    def save_rows(self, directory: str | Path, through_step: int) -> None:
        """Copy the rows of steps <= through_step into a checkpoint being written in `directory`."""
        rows = [line for line, row in _parsed_lines(self.path) if row is not None and row["step"] <= through_step]
        (Path(directory) / CHECKPOINT_ROWS).write_text("".join(rows))

    def detach_wandb(self):
        """The W&B run, which `close` then leaves running: the logger after a restart within the same command goes
        on with it (one W&B run per `raygrpo train`, not one per start of the actors). W&B ignores rows of a step
        it already has: the redone steps keep their first rows there (metrics.jsonl keeps the new ones)."""
        run, self._wandb = self._wandb, None
        return run

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb:
            try:
                self._tb.close()
            except Exception as e:  # noqa: BLE001 - closing after a failed write: say it, do not mask the first error
                print(f"TensorBoard: could not finish writing {self._tb_dir} ({type(e).__name__}: {e})",
                      file=sys.stderr, flush=True)
        if self._wandb:
            self._wandb.finish()


WANDB_INIT_TIMEOUT_S = 30.0  # how long wandb.init may try to reach W&B online before the run logs offline


def start_wandb(wandb_init: dict, run_dir: Path, config: dict):
    """A W&B run in RUN_DIR/wandb/. WANDB_MODE (online, offline, disabled) and the API key are the user's
    settings, read by wandb itself. Without a key wandb would prompt on a terminal and fail anywhere else
    (a submitted job, nohup, CI); rather than lose the run's W&B record, raygrpo then logs offline, says
    so, and names the `wandb sync` command that uploads it later. The same when W&B's server does not answer
    within WANDB_INIT_TIMEOUT_S (WANDB_INIT_TIMEOUT if set): no network."""
    try:
        import wandb as wb
    except ImportError:  # a default install has it (setup.py); an environment built without it still trains
        print("metrics.wandb=true but wandb is not installed (pip install wandb); logging to JSONL/TensorBoard only",
              file=sys.stderr)
        return None
    kwargs = {**wandb_init, "dir": str(run_dir), "config": config}
    # W&B's own init_timeout (90 s) unless the user set it: no network cost a run ~105 s, then ended it (issue 59)
    timeout = float(os.environ.get("WANDB_INIT_TIMEOUT") or WANDB_INIT_TIMEOUT_S)
    try:
        return wb.init(**kwargs, settings={"init_timeout": timeout})
    except wb.errors.UsageError as e:
        if "API key" not in str(e):
            raise
        why = "no W&B API key is configured (WANDB_API_KEY, or `wandb login`)"
    except getattr(wb.errors, "Error", ()) as e:
        if isinstance(e, getattr(wb.errors, "AuthenticationError", ())) or not wandb_unreachable(e):
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        why = f"W&B's server did not answer within {timeout:.0f}s (wandb: {first}; no network?)"
    print(f"metrics.wandb=true but {why}: logging offline into {run_dir}/wandb/; `wandb sync "
          f"{run_dir}/wandb/offline-run-*` uploads it later (WANDB_MODE=offline says so up front, without the wait)",
          file=sys.stderr, flush=True)
    return wb.init(**kwargs, mode="offline")


def wandb_unreachable(e: BaseException) -> bool:
    """Whether a wandb.init error says W&B's server could not be reached (its CommError, or its timeout's words)."""
    text = str(e).lower()
    return type(e).__name__ == "CommError" or "timed out" in text or "init_timeout" in text


def _quiet_tensorboard_writer_threads() -> None:
    """TensorBoard writes from a thread of its own, and when a write fails (a full disk) that thread prints a
    40-line traceback without the path. The logger raises the same error itself, naming the path and the
    free space, at the step it happens (log_step flushes), so the thread's own report is left out."""
    previous = threading.excepthook
    if getattr(previous, "raygrpo_quiet_tensorboard", False):
        return

    def hook(args):
        if type(args.thread).__name__ != "_AsyncWriterThread":  # tensorboard.summary.writer.event_file_writer
            previous(args)

    hook.raygrpo_quiet_tensorboard = True
    threading.excepthook = hook


def _parsed_lines(path: Path) -> list[tuple[str, dict | None]]:
    """(line, its row or None when it is not a whole row: cut short, or not ours) for every line of `path`."""
    out = []
    for line in path.read_text().splitlines(keepends=True) if path.is_file() else []:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            row = row if isinstance(row, dict) and isinstance(row.get("step"), int) and line.endswith("\n") else None
        except ValueError:
            row = None
        out.append((line if line.endswith("\n") else line + "\n", row))
    return out


def read_rows(path: str | Path) -> list[dict]:
    """The whole rows of a metrics file (e.g. a checkpoint's copy); [] when there is none."""
    return [row for _, row in _parsed_lines(Path(path)) if row is not None]


def supersede_rows(path: Path, start_step: int, carried: list[dict] | None = ()) -> tuple[int, int]:
    """Make `path` hold each step once when a run (re)starts at `start_step`: rows of later steps, a
    line cut short by a crash and the earlier of two rows of one step move to `<path>.superseded`, since
    those steps are redone; rows of earlier steps that the file lost are restored from `carried` (the
    checkpoint's copy). Evaluations at `start_step` stay, except the one before training (step 0),
    which is redone. `carried` None: a file of several rows a step (completions.jsonl), which is neither
    deduplicated nor restored. Returns (rows moved aside, rows restored)."""
    def stays(row: dict) -> bool:
        step = row["step"]
        return step < start_step or (step == start_step and (row.get("kind") == "train" or start_step > 0))

    lines = _parsed_lines(path)
    one_per_step = carried is not None
    last = {(row.get("kind"), row["step"]): i for i, (_, row) in enumerate(lines) if row is not None}
    keep, moved = [], []
    for i, (line, row) in enumerate(lines):  # of a step written twice (an older raygrpo's resume) the later row stays
        if row is None or not stays(row) or (one_per_step and last[(row.get("kind"), row["step"])] != i):
            moved.append(line)
        else:
            keep.append((row, line))
    restore = [r for r in carried or () if stays(r) and (r.get("kind"), r["step"]) not in last]
    if restore:  # in step order, a step's evaluation after its training row
        keep += [(r, json.dumps(r) + "\n") for r in restore]
        keep.sort(key=lambda x: (x[0]["step"], x[0].get("kind") == "eval"))
    if moved:
        with open(path.with_name(path.name + ".superseded"), "a") as f:
            f.writelines(moved)
    if moved or restore:
        replace_text(path, "".join(line for _, line in keep), durable=True)  # as durable as each row's write
    return len(moved), len(restore)


def read_metrics(run_dir: str | Path, kind: str = "train", warn: bool = True) -> list[dict]:
    """The rows of one kind, one per step (a later row for the same step wins); lines cut short by a
    crash are skipped, and (warn) one warning says how many and which."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a run dir written by `raygrpo train`?")
    found, torn = read_jsonl(path)
    if torn and warn:
        print(torn_note(path, torn), file=sys.stderr, flush=True)
    rows = {row["step"]: row for row in found if row.get("kind") == kind and isinstance(row.get("step"), int)}
    return [rows[s] for s in sorted(rows)]


def first_eval(run_dir: str | Path) -> dict | None:
    """The held-out evaluation logged before training (step 0), e.g. by the run a resume continues."""
    if not (Path(run_dir) / "metrics.jsonl").is_file():
        return None
    rows = [r for r in read_metrics(run_dir, "eval") if r["step"] == 0]
    return {k: v for k, v in rows[0].items() if k not in ("kind", "step")} if rows else None


def run_beta(run_dir: Path) -> float | None:
    """algo.beta of the run, from the config.yaml `raygrpo train` saves in its run dir (None: unknown)."""
    try:
        return float(yaml.safe_load((run_dir / "config.yaml").read_text())["algo"]["beta"])
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
        return None


def write_plots(run_dir: str | Path) -> None:
    """plot_run at a run's end or halt: a plot that fails is reported, never the run's end (the
    metrics are safe in metrics.jsonl; `raygrpo plot` writes the plots again)."""
    try:
        plot_run(run_dir)
    except Exception as e:  # noqa: BLE001
        print(f"plots were not written ({type(e).__name__}: {e}); `raygrpo plot {run_dir}` writes them", flush=True)


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write reward.png, kl.png and step_time.png (gen/reward/ref/train/sync split) into the run dir.
    matplotlib's object API, not pyplot: no backend is switched and no figure is left in pyplot's global
    state of a user who trains from a notebook (and pyplot's import is not paid in every run's driver)."""
    from matplotlib.figure import Figure

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    if not rows:
        raise FileNotFoundError(f"{run_dir}/metrics.jsonl has no training steps to plot")
    evals = read_metrics(run_dir, "eval", warn=False)  # the train read said it
    steps = [r["step"] for r in rows]

    def col(key):
        return [r.get(key) if r.get(key) is not None else float("nan") for r in rows]

    out = []
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    ax.plot(steps, col("reward_mean"), label="train reward (mean)")
    if evals and "accuracy" in evals[0]:
        ax.plot([e["step"] for e in evals], [e["accuracy"] for e in evals], "o-", label="held-out accuracy (greedy)")
    ax.set_xlabel("step"), ax.set_ylabel("reward"), ax.legend(), ax.grid(alpha=0.3)
    ax.set_title("reward")
    out.append(run_dir / "reward.png")
    fig.savefig(out[-1], dpi=100, bbox_inches="tight")

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    kl = col("kl")
    ax.plot(steps, kl, label="KL(pi || ref)")
    if run_beta(run_dir) == 0 or not any(math.isfinite(v) and v != 0 for v in kl):
        ax.text(0.5, 0.5, "no KL term in this run (algo.beta = 0): nothing to plot.\n"
                "Set algo.beta > 0 to penalise drifting from the reference model.",
                transform=ax.transAxes, ha="center", va="center")
    ax.set_xlabel("step"), ax.set_ylabel("kl"), ax.grid(alpha=0.3), ax.legend()
    ax.set_title("KL to the reference")
    out.append(run_dir / "kl.png")
    fig.savefig(out[-1], dpi=100, bbox_inches="tight")

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    parts = ["gen_s", "reward_s", "ref_s", "train_s", "sync_s"]
    bottom = [0.0] * len(steps)
    for key in parts:
        vals = [v if math.isfinite(v) else 0.0 for v in col(key)]
        ax.bar(steps, vals, bottom=bottom, label=key[:-2])
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.plot(steps, col("step_s"), "k.-", label="step (wall)")
    ax.set_xlabel("step"), ax.set_ylabel("seconds"), ax.legend(), ax.grid(alpha=0.3)
    ax.set_title("step time")
    out.append(run_dir / "step_time.png")
    fig.savefig(out[-1], dpi=100, bbox_inches="tight")
    return out
