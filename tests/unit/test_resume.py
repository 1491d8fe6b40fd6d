"""cluster/run/resume.py: where a run starts, decided before any actor starts."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from cluster.config import RunConfig
from cluster.run.resume import finished_run, resume_point
from learner import checkpoint as ck


def save(root: Path, step: int, **state) -> str:
    tmp = ck.begin(root, step)
    (Path(tmp) / ck.LEARNER_TAG).mkdir()
    (Path(tmp) / ck.LEARNER_TAG / "w.pt").write_bytes(b"w")
    return ck.commit(tmp, root, step, {"weight_version": step, **state}, keep=5)


def cfg_for(run_dir: Path, resume: str = "auto", steps: int = 4) -> RunConfig:
    cfg = RunConfig()
    cfg.trainer.run_dir, cfg.checkpoint.resume, cfg.trainer.steps = str(run_dir), resume, steps
    return cfg


def test_the_mode_picks_the_start_and_a_restart_takes_the_runs_own_newest(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    elsewhere = save(tmp_path / "other", 1)
    assert resume_point(cfg_for(tmp_path / "run")).path is None  # nothing yet: step 0
    newest = save(root, 3)
    assert resume_point(cfg_for(tmp_path / "run")).step == 3
    assert resume_point(cfg_for(tmp_path / "run", "none")).path is None
    assert str(resume_point(cfg_for(tmp_path / "run", elsewhere)).path) == elsewhere
    # after a dead learner rank every actor restarts: from this run's newest checkpoint, not the
    # mode's starting point (which would throw away the steps trained since)
    for mode in ("none", elsewhere, "auto"):
        assert str(resume_point(cfg_for(tmp_path / "run", mode), restarting=True).path) == newest


def test_only_a_run_that_finished_its_steps_is_finished(tmp_path, capsys):
    run = tmp_path / "run"
    save(run / "checkpoints", 4)  # a SIGTERM at the last step: saved, but no final evaluation / export
    assert finished_run(cfg_for(run), resume_point(cfg_for(run))) is None
    save(run / "checkpoints", 4, finished=True)
    (run / "hf_model").mkdir()
    (run / "hf_model" / "config.json").write_text("{}")  # a whole export: config and weights (learner/hf_dir.py)
    save_file({"w": torch.zeros(2)}, str(run / "hf_model" / "model.safetensors"))
    done = finished_run(cfg_for(run), resume_point(cfg_for(run)))
    assert done["finished_already"] and "already finished its 4 steps" in capsys.readouterr().out
    assert finished_run(cfg_for(run, steps=6), resume_point(cfg_for(run, steps=6))) is None  # more steps: go on
