"""Where the numbers go: a progress bar, `metrics.jsonl`, TensorBoard, optional wandb, PNG plots."""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import yaml
from tqdm import tqdm

from cluster.run import completions
from cluster.run.completions import COMPLETIONS_FILE

# What the learner reports for a step that a step's line carries.
# train_threads_max: the most torch threads a rank trained with (more than its share where the
# collecting side lent its idle cores, cluster/launch/thread_budget.py).
LEARNER_KEYS = ("loss", "pg_loss", "kl", "clip_frac", "entropy", "grad_norm", "lr", "ratio_mean", "tis_weight_mean",
                "logprob_diff_mean", "logprob_diff_max", "train_threads_max")
# Multi-turn rollouts (rollout.env; NaN in single-turn runs): assistant turns and "tool" messages per
# trajectory, environment failures (each ended its trajectory), trajectories whose environment messages did
# not fit in rollout.max_model_len (each ended there), seconds the engines waited on environments,
# environment tokens per trajectory (in the context, out of the loss).
MULTITURN_KEYS = ("turns_mean", "tool_calls_mean", "env_errors", "env_overflows", "env_s", "env_tokens_mean")
# Completion lengths in model tokens over every scored completion of the step (TRL's names); clipped:
# the share cut at rollout.max_new_tokens. The turn_* ones: per assistant turn of multi-turn rollouts.
COMPLETION_KEYS = tuple(f"completions/{turn}{name}" for turn in ("", "turn_")
                        for name in ("mean_length", "min_length", "max_length", "clipped_ratio"))
# Every step's line carries exactly these keys (NaN when a value does not apply, e.g. kl at beta=0),
# and the run's per-reward-function keys rewards/<name>/<stat> (actors/rewards.py metric_keys).
# reward_unscorable: completions no reward function could score (a null), out of their group and the loss.
STEP_KEYS = (
    "step", "reward_mean", "reward_std", "reward_errors", "reward_unscorable", *LEARNER_KEYS,
    "gen_tokens", "gen_s", "reward_s", "ref_s", "train_s", "sync_s", "step_s", "weight_version", "staleness",
    "zero_var_groups", "skipped_prompts", "extra_prompts", "trained_groups", "rollout_restarts", "update_skipped",
    "sync_bytes", "sync_verified", "sync_verify_s", *COMPLETION_KEYS,
    *MULTITURN_KEYS,
)


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN; null reads as "not applicable"
    return v


class MetricsLogger:
    """One JSON line per step (and per evaluation) + TensorBoard (+ wandb) + a progress display."""

    def __init__(self, run_dir: str | Path, total_steps: int, start_step: int = 0, *, tensorboard: bool = True,
                 wandb_init: dict | None = None, config: dict | None = None, show_staleness: bool = False,
                 show_kl: bool = True, extra_keys: tuple[str, ...] = ()):
        """wandb_init: wandb.init's keywords (project, name, entity, tags); None: no W&B.
        show_staleness: the progress line says how many weight versions behind each batch was (async).
        show_kl: the progress line shows the KL (not in a run without a KL term, algo.beta = 0).
        extra_keys: this run's keys beside STEP_KEYS (the per-reward-function ones)."""
        self.run_dir = Path(run_dir)
        self.keys = (*STEP_KEYS, *extra_keys)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.total, self.start_step, self.t0 = total_steps, start_step, time.time()
        self.show_staleness, self.show_kl = show_staleness, show_kl
        for path in (self.path, self.run_dir / COMPLETIONS_FILE):
            moved = supersede_rows(path, start_step)
            if moved:
                print(f"resuming at step {start_step}: moved {moved} row(s) of later steps from {path} to "
                      f"{path.name}.superseded (they are redone now)", flush=True)
        self._tb = self._wandb = self._bar = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # Resuming: TensorBoard hides the earlier run's events of the steps redone now (the
            # ones supersede_rows moved aside; step 0's evaluation is redone too).
            purge = start_step + 1 if start_step > 0 else 0
            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=purge)
        if wandb_init is not None:
            try:
                import wandb as wb

                self._wandb = wb.init(**wandb_init, dir=str(self.run_dir), config=config or {})
            except ImportError:
                print("metrics.wandb=true but wandb is not installed; logging to JSONL/TensorBoard only", file=sys.stderr)
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
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step" and math.isfinite(v):
                    self._tb.add_scalar(f"train/{k}", v, step)
        if self._wandb:
            self._wandb.log({f"train/{k}": v for k, v in row.items() if isinstance(v, (int, float))}, step=step)
        done = step - self.start_step
        eta = (time.time() - self.t0) / max(done, 1) * (self.total - step)
        summary = f"reward {row['reward_mean']:.3f}  len {row['completions/mean_length']:.1f}"
        if row["completions/clipped_ratio"] > 0:
            summary += f" (clipped {100 * row['completions/clipped_ratio']:.0f}%)"
        if self.show_staleness:
            summary += f"  stale {row['staleness']}"
        summary += f"  step {row['step_s']:.1f}s  eta {eta / 60:.1f}m"
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix_str(summary)
        else:
            kl = f"  kl {row['kl']:.4f}" if self.show_kl and math.isfinite(row["kl"]) else ""
            print(f"step {step}/{self.total}  {summary}  loss {row['loss']:.4f}{kl}", flush=True)

    def log_completions(self, step: int, rows: list[dict]) -> None:
        """A few of the step's completions (cluster/run/completions.py): completions.jsonl, a TensorBoard
        text summary, a W&B table."""
        if not rows:
            return
        completions.write_rows(self.run_dir, step, rows)
        rows = [{"step": step, **r} for r in rows]
        if self._tb:
            self._tb.add_text("completions", completions.markdown(rows), step)
        if self._wandb:
            import wandb as wb

            columns, data = completions.table(rows)
            self._wandb.log({"completions": wb.Table(columns=columns, data=data)}, step=step)

    def log_eval(self, step: int, m: dict) -> None:
        self._write({"kind": "eval", "step": step, **m})
        if self._tb:
            for k, v in m.items():
                if isinstance(v, (int, float)):
                    self._tb.add_scalar(f"eval/{k}", v, step)
        if self._wandb:
            self._wandb.log({f"eval/{k}": v for k, v in m.items()}, step=step)
        text = "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in m.items())
        (self._bar.write if self._bar is not None else print)(f"eval @ step {step}: {text}")

    def note(self, text: str) -> None:
        (self._bar.write if self._bar is not None else print)(text)

    def _write(self, row: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({k: _jsonable(v) for k, v in row.items()}) + "\n")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb:
            self._tb.close()
        if self._wandb:
            self._wandb.finish()


def supersede_rows(path: Path, start_step: int) -> int:
    """Make `path` hold each step once when a run (re)starts at `start_step`: rows of later steps
    (and a line cut short by a crash) move to `<path>.superseded`, since those steps are redone.
    Evaluations at `start_step` stay, except the one before training (step 0), which is redone."""
    if not path.is_file():
        return 0
    keep, moved = [], []
    for line in path.read_text().splitlines(keepends=True):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            step = int(row["step"])
            stays = step < start_step or (step == start_step and (row.get("kind") == "train" or start_step > 0))
        except (ValueError, KeyError, TypeError):
            stays = False
        (keep if stays else moved).append(line if line.endswith("\n") else line + "\n")
    if moved:
        with open(path.with_name(path.name + ".superseded"), "a") as f:
            f.writelines(moved)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, path)
    return len(moved)


def read_metrics(run_dir: str | Path, kind: str = "train") -> list[dict]:
    """The rows of one kind, one per step (a later row for the same step wins); a line cut short
    by a crash is skipped with a warning."""
    rows: dict[int, dict] = {}
    path = Path(run_dir) / "metrics.jsonl"
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                row = json.loads(line)
            except ValueError:
                print(f"warning: {path}:{n} is not a complete JSON line (a run stopped while writing it?); skipped",
                      file=sys.stderr)
                continue
            if row.get("kind") == kind:
                rows[row["step"]] = row
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
    """Write reward.png, kl.png and step_time.png (gen/reward/ref/train/sync split) into the run dir."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    if not rows:
        raise FileNotFoundError(f"{run_dir}/metrics.jsonl has no training steps to plot")
    evals = read_metrics(run_dir, "eval")
    steps = [r["step"] for r in rows]

    def col(key):
        return [r.get(key) if r.get(key) is not None else float("nan") for r in rows]

    out = []
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, col("reward_mean"), label="train reward (mean)")
    if evals and "accuracy" in evals[0]:
        ax.plot([e["step"] for e in evals], [e["accuracy"] for e in evals], "o-", label="held-out accuracy (greedy)")
    ax.set_xlabel("step"), ax.set_ylabel("reward"), ax.legend(), ax.grid(alpha=0.3)
    ax.set_title("reward")
    out.append(run_dir / "reward.png")
    fig.savefig(out[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
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
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
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
    plt.close(fig)
    return out
