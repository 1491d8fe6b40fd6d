"""Where a run starts, decided before any actor starts: the checkpoint it resumes from, the metrics
rows that checkpoint carries, and whether the run is already done (the driver checks that checkpoint's
model against model.path: cluster/data/model_check.py).

A run that finished writes `"finished": true` into its final checkpoint's driver state. Rerun with the
same `trainer.steps`, it says so and exits: no actor starts, nothing is evaluated or written again
(an hf_model/ that is missing is exported from the final checkpoint, without actors). A larger
`trainer.steps` continues it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cluster.run.jsonl import read_jsonl, torn_note
from cluster.run.metrics import CHECKPOINT_ROWS
from learner import checkpoint
from learner.export import export_checkpoint
from learner.hf_dir import hf_dir_problem


@dataclass
class ResumePoint:
    path: Path | None = None  # the checkpoint to resume from; None: start at step 0
    state: dict = field(default_factory=dict)  # its driver state

    @property
    def step(self) -> int:
        return int(self.state.get("step", 0))

    def carried_rows(self) -> list[dict]:
        """The metrics rows the checkpoint carries (of the steps it covers); torn lines are named, and skipped."""
        if self.path is None:
            return []
        rows, torn = read_jsonl(self.path / CHECKPOINT_ROWS)
        if torn:
            print(torn_note(self.path / CHECKPOINT_ROWS, torn), flush=True)
        return [r for r in rows if isinstance(r.get("step"), int)]


def resume_point(cfg, restarting: bool = False) -> ResumePoint:
    """checkpoint.resume: auto (the run dir's newest complete checkpoint), none, or a checkpoint path.
    `cfg` is the run's config (cluster/config.py RunConfig). `restarting` (every actor restarted after a
    dead learner rank): this run's own newest checkpoint whatever the mode says, which is about where
    the run starts."""
    mode = cfg.checkpoint.resume
    found = checkpoint.latest_complete(Path(cfg.trainer.run_dir) / "checkpoints") if mode == "auto" or restarting \
        else None
    if found is None and mode not in ("auto", "none"):
        found = mode
    if found is None:
        return ResumePoint()
    path = Path(found)
    return ResumePoint(path, checkpoint.load_driver_state(path))


def finished_run(cfg, point: ResumePoint) -> dict | None:
    """The summary of a run that already finished its trainer.steps (saying so), or None."""
    if point.path is None or not point.state.get("finished") or point.step < cfg.trainer.steps:
        return None
    run_dir = Path(cfg.trainer.run_dir)
    hf = run_dir / "hf_model"
    problem = hf_dir_problem(hf) if hf.exists() else f"{hf} is missing"
    if problem:  # it stopped between its final checkpoint and the end of the export (an incomplete one moves aside)
        print(f"{problem} (the run stopped during its final export?): exporting it again from {point.path}", flush=True)
        export_checkpoint(point.path, hf, overwrite=True)
    print(f"run dir {run_dir} already finished its {point.step} steps (checkpoint {point.path}, HF model {hf}): "
          f"nothing to do. Raise trainer.steps to train on from there", flush=True)
    return {"run_dir": str(run_dir), "before": None, "after": None, "checkpoint": str(point.path),
            "hf_model": str(hf), "rollout_restarts": 0, "finished_already": True}
