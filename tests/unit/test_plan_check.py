"""cluster/bench/plan_check.py: the validation's bookkeeping, with the calibration, the runs and the plan
faked (the real thing trains for half an hour: docs/plan.md has its table)."""
from cluster.bench import plan_check
from cluster.plan.profile import CalibrationProfile


def test_each_config_is_predicted_and_measured_and_a_failed_run_is_kept_as_one(monkeypatch, tmp_path):
    prof = CalibrationProfile(machine="m", cores=2, model="x", model_params=1, dtype_bytes=4)
    monkeypatch.setattr(plan_check, "calibrate", lambda model, base, run_dir, rewards: prof)
    monkeypatch.setattr(plan_check, "MODELS", {"tiny": ("m", ["trainer.steps=6"], {
        "async": ["trainer.mode=async"], "broken": ["rollout.num_workers=2"]})})
    seen = []

    def train(config, overrides, run_dir):
        seen.append(overrides)
        if "rollout.num_workers=2" in overrides:
            raise plan_check.RunFailed("engine died")
        return {"step_s": 2.0, "gen_s": 1.2, "train_s": 0.6, "learner_peak_bytes": 100 * 2**20,
                "load_before": 1.0, "load_after": 2.0}

    monkeypatch.setattr(plan_check, "train_and_measure", train)
    monkeypatch.setattr(plan_check, "predict", lambda path, ovr, profile: {
        "step_s": 2.5, "learner_peak_bytes": 90 * 2**20, "phases": {}})
    rows = plan_check.check_model("tiny", tmp_path)
    assert seen == [["trainer.steps=6", "trainer.mode=async"], ["trainer.steps=6", "rollout.num_workers=2"]]
    assert rows[0]["step_ratio"] == 1.25 and rows[0]["peak_ratio"] == 0.9
    assert "engine died" in rows[1]["error"]
    text = plan_check.table(rows)
    assert "| 1.25 |" in text and "failed: engine died" in text and "1.0-2.0" in text
