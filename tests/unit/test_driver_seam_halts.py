"""Halts and ends the driver decides, at its seam (issue 58, item 3): tests/unit/test_driver_seam.py's run over
tests/fakes, each with one fault turned on. Each was an end-to-end run of its own (an engine and a learner group
started for one halt); what a real stack adds to each is named where it is still shown end to end:
  - a reward that goes flat after a signal: the halt, its checkpoint and plots. The plots a real halt writes:
    tests/e2e/test_reward_fails_alone_end_to_end.py (the same _check_health path);
  - a full disk under completions.jsonl: the run ends naming the path. SaveError through the CLI (exit 1, no
    traceback): tests/e2e/test_bad_inputs.py's full disk under tensorboard/;
  - the only engine dead past its restart budget: the run fails at once naming it. Ray's own table saying DEAD
    for an actor with max_restarts=0: tests/e2e/test_safety.py;
  - an engine that does not hold the update it was sent: the run halts at that step naming it. The real check
    (a real engine's fingerprint against a real learner's, failing the sync as SyncMismatch through Ray):
    tests/e2e/test_learner_weight_sync.py;
  - an environment whose every reset raises: said at each step, the run halts naming it. A real engine's
    trajectories ended at reset: tests/e2e/test_multiturn.py; a halt's exit 3 through the CLI:
    tests/e2e/test_reward_fails_alone_end_to_end.py."""
from __future__ import annotations

import time

import pytest

import cluster.driver.trainer as trainer_module
from cluster.launch.waits import ActorFailed
from cluster.run.health import TrainingHalted
from cluster.run.metrics import read_metrics
from learner.checkpoint import SaveError
from tests.fakes.ray_like import die
from tests.unit.test_driver_seam import G, run, train


def test_a_reward_that_goes_flat_after_a_signal_halts_with_a_checkpoint_the_plots_and_a_diagnosis(
        tmp_path, monkeypatch):
    """Step 1's rewards differ within every group, then every reward is 1.0: the signal was lost, so after
    trainer.halt_after=2 such steps the run halts (steps 2 and 3, before its last) with the checkpoint of step 3
    saved and the plots written first, and a diagnosis saying what to change and where to look. (A run that
    never had a signal is warned about, not halted: tests/unit/test_health.py.)"""
    calls = []

    def goes_flat(text: str, fields: dict) -> float:
        calls.append(text)
        return float(len(calls)) if len(calls) <= 2 * G else 1.0  # step 1: 2 prompts x G completions

    r = run(tmp_path, monkeypatch, steps=5, halt_after=2, functions={"flat": goes_flat})
    plotted = []
    monkeypatch.setattr(trainer_module, "write_plots", lambda run_dir: plotted.append((run_dir, list(r.saved))))
    with pytest.raises(TrainingHalted) as halt:
        train(r)
    said = str(halt.value)
    assert "no learning signal" in said and "for 2 consecutive steps" in said, said
    assert "reward function" in said and f"raygrpo show {tmp_path}" in said, said  # what to change, where to look
    rows = read_metrics(tmp_path)
    assert [row["step"] for row in rows] == [1, 2, 3] and r.saved == [3] and len(r.rank.batches) == 3
    assert [row["zero_var_groups"] for row in rows] == [0, 2, 2]
    assert plotted == [(tmp_path, [3])]  # the plots, after the checkpoint and before the halt


def test_a_full_disk_under_completions_jsonl_ends_the_run_naming_the_path_and_keeps_the_steps_row(
        tmp_path, monkeypatch):
    """completions.jsonl is a link to /dev/full (every write: ENOSPC), as on a full disk: step 1's row is written,
    then its completions fail, and the run ends with the path, the cause and the free space, not a traceback
    from deep in the logger."""
    r = run(tmp_path, monkeypatch, steps=3)
    (tmp_path / "completions.jsonl").symlink_to("/dev/full")
    with pytest.raises(SaveError) as e:
        train(r)
    said = str(e.value)
    assert f"could not write {tmp_path / 'completions.jsonl'}: the disk is full" in said, said
    assert "MiB free on that filesystem" in said, said
    assert [row["step"] for row in read_metrics(tmp_path)] == [1]  # written before, kept


def test_the_only_engine_dead_past_its_restart_budget_fails_the_run_at_once_naming_it(tmp_path, monkeypatch):
    """rollout.max_restarts=0 and engine 0, the only one, dies after step 1: Ray will not restart it (its state
    DEAD), so step 2's generation fails the run at once naming the worker and the setting, instead of polling
    a dead actor for trainer.actor_timeout_s."""
    r = run(tmp_path, monkeypatch, engines=1, min_workers=1, steps=3, faults={1: lambda run: die(run.engines[0])})
    t0 = time.monotonic()
    with pytest.raises(ActorFailed) as e:
        train(r)
    said = str(e.value)
    assert "rollout worker 0" in said and "rollout.max_restarts=0" in said and "rollout.min_workers=1" in said, said
    assert time.monotonic() - t0 < r.trainer.cfg.trainer.actor_timeout_s / 2  # at once: it did not wait it out
    assert [row["step"] for row in read_metrics(tmp_path)] == [1] and len(r.rank.batches) == 1


def test_an_engine_not_holding_the_update_it_was_sent_halts_the_run_at_that_step_naming_it(tmp_path, monkeypatch):
    """After step 1's update, engine 0 of 2 stops taking updates in: step 2's verified sync raises SyncMismatch
    (FakeLearnerRank, as the real sender's fingerprint check does), and the run halts at step 2 naming the engine,
    before any prompt is sampled from weights other than the ones trained. Step 1's row is kept."""
    wrong_from_now = {1: lambda run: setattr(run.engines[0], "wrong_weights", True)}
    r = run(tmp_path, monkeypatch, steps=3, faults=wrong_from_now)
    with pytest.raises(TrainingHalted) as halt:
        train(r)
    said = str(halt.value)
    assert said.startswith("step 2: rollout worker 0 holds other weights than version 2 (fake)"), said
    assert f"Metrics and checkpoints so far are in {tmp_path}" in said, said
    rows = read_metrics(tmp_path)
    assert [row["step"] for row in rows] == [1] and rows[0]["sync_verified"] is True
    assert len(r.rank.batches) == 2  # step 2 trained; its update is what failed
    assert [len(e.served) for e in r.engines] == [2, 2]  # steps 1 and 2 sampled, nothing after the halt


def test_an_environment_that_fails_every_reset_is_said_at_each_step_and_halts_the_run_naming_it(
        tmp_path, monkeypatch, capsys):
    """Issue 30 case 5 (an environment's reset that raised failed every trajectory; env_errors counted it in the
    metrics only, the run exited 0, and the health guard said "policy collapsed"): a multi-turn run (rollout.env)
    whose every reset() raises. Each step says so on the console when it happens, with the first error; after
    trainer.halt_after=2 such steps, before the run's last, the run halts with the checkpoint saved, naming the
    environment, not the policy. (It was tests/e2e/test_environment_failures.py's training half, an engine and a
    learner group started for it; issue 58. A real engine's reset failure ending its trajectories before any
    turn: tests/e2e/test_multiturn.py; TrainingHalted through the CLI, exit 3 and the halt line:
    tests/e2e/test_reward_fails_alone_end_to_end.py. Its evaluation half, hanging and flooding environments:
    tests/e2e/test_external_cluster.py's run by address.)"""
    r = run(tmp_path, monkeypatch, steps=3, halt_after=2, functions={"f": lambda text, fields: 0.0})
    r.trainer.cfg.rollout.env = "my_env.py:Tool"  # multi-turn: the collector asks generate_multiturn
    for e in r.engines:
        e.env_reset_error = "RuntimeError: no sandbox available"
    with pytest.raises(TrainingHalted) as halt:
        train(r)
    said = str(halt.value)
    assert "the environment failed every trajectory (4 env_errors)" in said and "rollout.env" in said, said
    assert "for 2 consecutive steps" in said and "collapsed" not in said and "learning signal" not in said, said
    console = capsys.readouterr()
    for step in (1, 2):
        assert (f"environment: 4 of 4 trajectories failed at step {step} (each ended there; counted as env_errors), "
                "first: reset: RuntimeError: no sandbox available") in console.err, console.err
    rows = read_metrics(tmp_path)
    assert [row["step"] for row in rows] == [1, 2] and [row["env_errors"] for row in rows] == [4, 4]
    assert r.saved == [2]  # the checkpoint, before the halt
    assert [len(e.served) for e in r.engines] == [2, 2]  # steps 1 and 2 asked each engine, nothing after the halt
