"""The engine actor's Ray options carry rollout.max_restarts (Ray restarts a dead engine that many times, then the
driver's budget rules: tests/unit/test_driver_seam_halts.py) and max_task_retries=0 (the call in flight fails, so the
driver knows). The e2e test that killed an engine past its budget moved to the seam (issue 58); this holds the one
line between the config and Ray that it also covered."""
from __future__ import annotations

from test_rundir import cfg_for

from cluster.launch import placement


class RecordingRemote:
    """Stands in for ray.remote(RolloutWorker): records .options(...) and .remote(...)."""

    def __init__(self, cls):
        self.cls, self.options_seen, self.args_seen = cls, None, None

    def options(self, **options):
        self.options_seen = options
        return self

    def remote(self, *args, **kwargs):
        self.args_seen = (args, kwargs)
        return self


def test_start_engine_passes_the_restart_budget_and_no_task_retries_to_ray(tmp_path, monkeypatch):
    import ray

    made = []
    monkeypatch.setattr(ray, "remote", lambda cls: made.append(RecordingRemote(cls)) or made[-1])
    cfg = cfg_for(tmp_path, "rollout.max_restarts=5", "rollout.num_cpus=1.5")
    placement.start_engine(cfg, index=2)
    (engine,) = made
    assert engine.cls is placement.RolloutWorker
    assert engine.options_seen["max_restarts"] == 5 and engine.options_seen["max_task_retries"] == 0
    assert engine.options_seen["num_cpus"] == 1.5
    assert engine.args_seen[1]["worker_index"] == 2
