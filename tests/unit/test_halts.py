"""Trainer._check_health: a guard that trips before the last step halts with a checkpoint, the plots and
a pointer to the logged completions; one that trips at the last step lets the run end as usual.
The trainer's actors are faked (a checkpoint is a path); the health monitor and the plots are real."""
from types import SimpleNamespace

import pytest

from cluster.config import RunConfig
from cluster.driver.batch import CollectStats
from cluster.driver.trainer import Trainer
from cluster.run.health import HealthMonitor, TrainingHalted
from cluster.run.metrics import MetricsLogger


def trainer(tmp_path, steps, at_step):
    cfg = RunConfig()
    cfg.trainer.steps, cfg.trainer.halt_after, cfg.trainer.entropy_floor = steps, 1, 100.0
    t = Trainer.__new__(Trainer)
    t.cfg, t.run_dir, t.step = cfg, tmp_path, at_step
    t.scorer = SimpleNamespace(timeout_setting=lambda name: None)
    t.health = HealthMonitor(cfg.trainer, beta=0.0, mismatch_expected=False, run_dir=str(tmp_path))
    t.log = MetricsLogger(tmp_path, steps, tensorboard=False)
    t.save_checkpoint = lambda: tmp_path / "checkpoints" / f"step-{at_step:08d}"
    for step in range(1, at_step + 1):
        t.log.log_step({"step": step, "reward_mean": 0.5, "entropy": 1.0, "step_s": 1.0})
    return t


def test_a_guard_before_the_last_step_halts_with_checkpoint_plots_and_completions_pointer(tmp_path):
    t = trainer(tmp_path, steps=5, at_step=2)
    batch = SimpleNamespace(stats=CollectStats(groups=4))
    with pytest.raises(TrainingHalted) as e:
        t._check_health({"step": 2, "entropy": 1.0, "zero_var_groups": 0}, batch)
    assert "policy collapsed" in str(e.value) and "step-00000002 was saved" in str(e.value)
    assert f"raygrpo show {tmp_path}" in str(e.value)
    assert all((tmp_path / f).is_file() for f in ("reward.png", "kl.png", "step_time.png"))


def test_a_guard_at_the_last_step_lets_the_run_end_as_usual(tmp_path, capsys):
    t = trainer(tmp_path, steps=2, at_step=2)
    t._check_health({"step": 2, "entropy": 1.0, "zero_var_groups": 0}, SimpleNamespace(stats=CollectStats(groups=4)))
    out = capsys.readouterr().out
    assert "health: WARNING: token entropy 1 < trainer.entropy_floor 100" in out
    assert "This was the run's last step, so the run ends normally" in out
    assert not (tmp_path / "reward.png").exists()  # the plots come with the run's usual end, not from here
