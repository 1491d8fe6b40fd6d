"""A reward function fails alone (issue 36, item 1): the scorer leaves a broken function out and
renormalises the others, says each failing function with its own first error; the health guard warns,
then halts after trainer.halt_after steps naming exactly the functions that failed; a step no function
scored halts at once; and the driver loop writes the step's metrics row before either halt.

The scorer and the health monitor are real; the driver loop is the real `Trainer._train` over the
collecting fakes of test_collect.py (no Ray, no engines)."""
from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from local_http import LocalServer, QuietHandler

from actors.config import RewardConfig
from actors.rewards.scorer import REWARD_STATS, RewardScorer
from cluster.config import TrainerConfig
from cluster.run.health import HealthMonitor, TrainingHalted
from cluster.run.metrics import MetricsLogger, read_metrics
from tests.unit.test_collect import trainer as collecting_trainer


@pytest.fixture
def broken_verifier():
    class Handler(QuietHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send(500, b'{"error": "down"}')

    server = LocalServer(Handler)
    yield f"{server.base}/verify"
    server.close()


def test_a_verifier_answering_500_fails_alone_and_the_others_are_renormalised(broken_verifier, capsys):
    cfg = RewardConfig(functions=["exact_match", broken_verifier], weights=[1.0, 3.0], names=["exact", "down"],
                       http_max_retries=0, fallback=-5.0)
    with RewardScorer(cfg) as scorer:
        res = scorer.score(["1+1="] * 4, ["2", "3", "2", "2"], [{"answer": "2"}] * 4, group_size=2)
    # the verifier failed both groups whole: left out; exact_match's weight 1 scaled by (1 + 3) / 1
    assert res.rewards == [4.0, 0.0, 4.0, 4.0] and res.failed == [False] * 4 and res.errors == 4
    down = res.functions["down"]
    assert down.failed_every_call and down.errors == 4 and "HTTP 500" in down.first_error
    assert not res.functions["exact"].failed_every_call and res.functions["exact"].first_error is None
    err = capsys.readouterr().err
    assert "reward: down failed 4 of 4 sample(s) (4 left out of their prompt's sum, the other functions' weights " \
           f"renormalised), first: {broken_verifier}: HTTP 500" in err
    assert "reward: exact" not in err  # only a function that failed is said


def health(halt_after=2):
    return HealthMonitor(TrainerConfig(halt_after=halt_after), beta=0.0, mismatch_expected=False)


ERRORS = {"a": "the reward function a failed every call (8 error(s)), first: HTTP 500",
          "b": "the reward function b failed every call (8 error(s)), first: not JSON",
          "c": "the reward function c failed some calls (2 error(s)), first: boom"}


def test_a_function_failing_every_call_is_warned_then_halts_after_halt_after_steps_naming_exactly_it():
    m, row = health(halt_after=3), {"step": 1, "zero_var_groups": 0}
    v = m.check(row, 4, reward_errors=ERRORS, failed_functions=["a", "b"])
    assert v.halt is None and len(v.warnings) == 2
    assert v.warnings[0] == ("step 1: the reward function a failed every call (8 error(s)), first: HTTP 500; the step "
                             "went on with the other reward functions, their weights renormalised (1 step(s) in a row; "
                             "the run halts at 3)")
    v = m.check({**row, "step": 2}, 4, reward_errors=ERRORS, failed_functions=["a"])  # b recovered: its streak ends
    assert v.halt is None and m.failing == {"a": 2}
    v = m.check({**row, "step": 3}, 4, reward_errors=ERRORS, failed_functions=["a", "b"])
    assert v.halt.startswith("1 reward function(s) failed every call for 3 consecutive steps: "
                             "the reward function a failed every call (8 error(s)), first: HTTP 500. ")
    assert "function b" not in v.halt and "function c" not in v.halt
    never = health(halt_after=0)
    assert all(never.check(row, 4, reward_errors=ERRORS, failed_functions=["a"]).halt is None for _ in range(5))


def test_a_step_no_function_scored_halts_at_once_naming_every_function_that_failed():
    for halt_after in (0, 10):
        v = health(halt_after).check({"step": 1, "zero_var_groups": 4}, 4, unscored=True, reward_errors=ERRORS,
                                     failed_functions=["a", "b"])
        assert v.halt.startswith(f"no reward function scored any sample at step 1 (each got reward.fallback): "
                                 f"{ERRORS['a']}; {ERRORS['b']}; {ERRORS['c']}. ")
        assert "nothing was trained at this step" in v.halt and not v.warnings  # not also called a collapsed policy


def loop(tmp_path, rewards_per_prompt, steps=3, halt_after=2):
    """The real driver loop over test_collect.py's fakes: the fake scorer's function is called `f`."""
    learners = SimpleNamespace(train=lambda batch: t.trained.append(batch) or {"tokens": 1},
                               sync_weights=lambda version, watch=None: {"bytes": 1, "verified": True}, train_calls=0)
    t = collecting_trainer(rewards_per_prompt, want=2, learners=learners)
    t.cfg.trainer.steps, t.cfg.trainer.halt_after = steps, halt_after
    t.run_dir, t.heldout, t.resumed_batch, t.regenerated_on_resume, t.pad_id = tmp_path, None, None, 0, 0
    t.stop = SimpleNamespace(armed=False, requested=False)
    t.health = HealthMonitor(t.cfg.trainer, beta=0.0, mismatch_expected=False, run_dir=str(tmp_path))
    t.log = MetricsLogger(tmp_path, steps, tensorboard=False, extra_keys=tuple(f"rewards/f/{s}" for s in REWARD_STATS))
    t.trained = []
    t.save_checkpoint = lambda finished=False: tmp_path / f"step-{t.step:08d}"
    return t


def test_the_loop_writes_the_steps_row_then_halts_when_no_function_scored(tmp_path):
    nan = float("nan")
    t = loop(tmp_path, [[nan, nan]] * 6)
    with pytest.raises(TrainingHalted, match=r"no reward function scored any sample at step 1 .*the reward function f "
                                             r"failed every call \(4 error\(s\)\), first: boom"):
        t._train()
    [row] = read_metrics(tmp_path)
    assert row["step"] == 1 and row["rewards/f/errors"] == 4 and row["reward_errors"] == 4
    assert row["update_skipped"] is True and row["trained_groups"] == 0 and t.trained == []  # nothing learned from it
    t.log.close()


def test_the_loop_goes_on_while_any_group_is_scored_and_writes_each_row_before_the_halt(tmp_path):
    """The fake scorer has one function: it scores group 1 of steps 1-2 and fails group 2 whole (that group
    gets reward.fallback), so training goes on; at step 3 it fails every group, and the run halts after
    that step's row. (A function failing alone for halt_after steps halts through the same path: the
    guard's test above, and the e2e run.)"""
    nan = float("nan")
    t = loop(tmp_path, [[1, 0], [nan, nan], [0, 1], [nan, nan], [nan, nan], [nan, nan]], steps=4)
    with pytest.raises(TrainingHalted, match="no reward function scored any sample at step 3"):
        t._train()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3] and [r["rewards/f/errors"] for r in rows] == [2, 2, 4]
    assert len(t.trained) == 2 and [r["update_skipped"] for r in rows] == [False, False, True]
    assert all(math.isfinite(r["reward_mean"]) for r in rows[:2])
    t.log.close()


def test_the_rule_is_stated_in_the_readme():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert "sum(|w| of all functions) / sum(|w| of the functions left)" in readme
    assert "reward.http_max_response_mb" in readme
