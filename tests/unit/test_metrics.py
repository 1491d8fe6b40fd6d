import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from cluster.config import MetricsConfig
from cluster.driver.batch import CollectStats
from cluster.run.metrics import CHECKPOINT_ROWS, STEP_KEYS, MetricsLogger, plot_run, read_metrics, read_rows
from cluster.run.resume import ResumePoint
from learner.checkpoint import SaveError


def test_every_step_line_has_the_required_keys_and_plots(tmp_path):
    log = MetricsLogger(tmp_path, total_steps=3, tensorboard=True)
    for step in (1, 2, 3):
        log.log_step({"step": step, "reward_mean": 0.1 * step, "loss": 0.5, "kl": float("nan"), "step_s": 1.0,
                      "gen_s": 0.4, "train_s": 0.3, "sync_s": 0.1})
    log.log_eval(3, {"accuracy": 0.5, "pass@4": 0.7})
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 3 and all(set(STEP_KEYS) <= set(r) for r in train)
    assert train[0]["kl"] is None  # NaN is written as null: valid JSON
    assert any((tmp_path / "tensorboard").iterdir())
    paths = plot_run(tmp_path)
    assert [p.name for p in paths] == ["reward.png", "kl.png", "step_time.png"]
    assert all(p.stat().st_size > 1000 and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_plotting_leaves_a_notebook_users_matplotlib_alone(tmp_path):
    """A user who trains from a notebook keeps their backend and pyplot's figures: plot_run neither switches
    the backend (it once called matplotlib.use("Agg")) nor imports pyplot. In a fresh process, whose
    backend the test sets as a user would."""
    log = MetricsLogger(tmp_path, total_steps=1, tensorboard=False)
    log.log_step({"step": 1, "reward_mean": 0.5, "step_s": 1.0})
    log.close()
    code = ("import sys, matplotlib; matplotlib.use('svg'); from cluster.run.metrics import plot_run; "
            f"paths = plot_run({str(tmp_path)!r}); "
            "print(matplotlib.get_backend(), 'matplotlib.pyplot' in sys.modules, len(paths))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["svg", "False", "3"], out.stdout


def test_resumed_steps_replace_earlier_rows(tmp_path):
    log = MetricsLogger(tmp_path, total_steps=3, tensorboard=False)
    log.log_step({"step": 1, "reward_mean": 0.1})
    log.log_step({"step": 2, "reward_mean": 0.2})
    log.log_step({"step": 2, "reward_mean": 0.25})  # the run resumed from step 1
    log.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and math.isclose(rows[1]["reward_mean"], 0.25)


def test_a_resume_moves_later_rows_aside_so_the_raw_file_holds_each_step_once(tmp_path):
    log = MetricsLogger(tmp_path, total_steps=4, tensorboard=False)
    log.log_eval(0, {"accuracy": 0.1})
    for step in (1, 2, 3):
        log.log_step({"step": step, "reward_mean": 0.1 * step})
    log.log_eval(2, {"accuracy": 0.2})
    log.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 4, "rew')  # the driver died mid-write
    log = MetricsLogger(tmp_path, total_steps=4, start_step=2, tensorboard=False)  # resumed from step 2
    for step in (3, 4):
        log.log_step({"step": step, "reward_mean": 1.0})
    log.close()
    raw = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in raw] == [
        ("eval", 0), ("train", 1), ("train", 2), ("eval", 2), ("train", 3), ("train", 4)]
    aside = (tmp_path / "metrics.jsonl.superseded").read_text().splitlines()
    assert len(aside) == 2 and json.loads(aside[0])["step"] == 3 and aside[1].startswith('{"kind": "train", "step": 4')


def test_a_restart_from_step_0_redoes_the_evaluation_before_training(tmp_path):
    log = MetricsLogger(tmp_path, total_steps=2, tensorboard=False)
    log.log_eval(0, {"accuracy": 0.1})
    log.log_step({"step": 1, "reward_mean": 0.1})
    log.close()
    MetricsLogger(tmp_path, total_steps=2, start_step=0, tensorboard=False).close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_reader_skips_a_truncated_last_line(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "reward_mean": 0.5}\n{"kind": "tr')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]
    err = capsys.readouterr().err
    assert "metrics.jsonl: skipped 1 torn line(s) (not whole JSON rows" in err and err.rstrip().endswith("line(s) 2")


def test_an_undeclared_step_metric_is_refused(tmp_path):
    log = MetricsLogger(tmp_path, total_steps=1, tensorboard=False)
    with pytest.raises(ValueError, match="not in cluster/run/metrics.py STEP_KEYS"):
        log.log_step({"step": 1, "reward_meen": 0.1})
    log.close()


@pytest.mark.parametrize("start_step", [0, 2])
def test_tensorboard_shows_a_redone_step_once(tmp_path, start_step):
    """A run that crashed after step 4 and resumes from the checkpoint of `start_step` (0: none):
    TensorBoard shows every step once, the redone ones with their new values."""
    first = MetricsLogger(tmp_path, total_steps=4, tensorboard=True)
    first.log_eval(0, {"accuracy": 0.1})
    for step in (1, 2, 3, 4):
        first.log_step({"step": step, "reward_mean": float(step)})
    first.close()
    resumed = MetricsLogger(tmp_path, total_steps=4, start_step=start_step, tensorboard=True)
    if start_step == 0:
        resumed.log_eval(0, {"accuracy": 0.2})
    for step in range(start_step + 1, 5):
        resumed.log_step({"step": step, "reward_mean": 10.0 * step})
    resumed.close()

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    reward = [(e.step, e.value) for e in events.Scalars("train/reward_mean")]
    assert reward == [(s, float(s) if s <= start_step else 10.0 * s) for s in (1, 2, 3, 4)]
    assert [(e.step, round(e.value, 3)) for e in events.Scalars("eval/accuracy")] == \
        [(0, 0.2 if start_step == 0 else 0.1)]


class FakeWandb:
    """Stands in for the wandb package (tests/e2e/test_progress_and_throughput.py runs the real one): records init's keywords
    and what is logged."""

    def __init__(self):
        self.inits, self.logged = [], []

    def init(self, **kw):
        self.inits.append(kw)
        return self

    def log(self, data, step):
        self.logged.append((step, data))

    def finish(self):
        pass

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data


def completion_rows():
    return [{"prompt_index": 0, "sample": 0, "prompt": "2+3=", "completion": "5", "reward": 1.0,
             "rewards": {"exact_match": 1.0}, "advantage": 0.5, "finish_reason": "stop", "num_tokens": 2}]


def test_completions_go_to_jsonl_tensorboard_and_a_wandb_table_with_the_run_name_entity_tags(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = MetricsConfig(wandb=True, wandb_project="p", wandb_run_name="gsm8k-try-3", wandb_entity="team",
                        wandb_tags=["gsm8k", "lora"])
    log = MetricsLogger(tmp_path, total_steps=2, tensorboard=True, wandb_init=cfg.wandb_init())
    log.log_completions(1, completion_rows())
    log.log_completions(2, [])  # nothing picked: nothing written
    log.close()
    assert fake.inits[0] | {"dir": None, "config": None, "settings": None} == {
        "project": "p", "name": "gsm8k-try-3", "entity": "team", "tags": ["gsm8k", "lora"], "dir": None, "config": None,
        "settings": None}
    assert MetricsConfig(wandb=True).wandb_init() == {"project": "raygrpo", "name": None, "entity": None, "tags": None}
    assert MetricsConfig().wandb_init() is None
    (step, data), = fake.logged
    assert step == 1 and data["completions"].columns[:5] == ["step", "prompt", "completion", "reward", "exact_match"]
    rows = [json.loads(x) for x in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, **completion_rows()[0]}]
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    (text,) = events.Tensors("completions/text_summary")
    assert text.step == 1 and b"reward 1.000 (exact_match 1.000)" in text.tensor_proto.string_val[0]


def test_a_restart_within_one_command_goes_on_with_the_same_wandb_run(tmp_path, monkeypatch):
    """Trainer._open_log after a dead learner rank: the new logger takes over the W&B run (a second wandb.init
    made a second offline run in the same run dir, seen in an e2e run whose learner's port was taken)."""
    class Recording(FakeWandb):
        finished = 0

        def finish(self):
            self.finished += 1

    fake = Recording()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    init = MetricsConfig(wandb=True).wandb_init()
    first = MetricsLogger(tmp_path, total_steps=4, tensorboard=False, wandb_init=init)
    first.log_step({"step": 1, "reward": 0.5})
    run = first.detach_wandb()
    first.close()
    assert run is fake and fake.finished == 0  # closing the first logger left the run going
    second = MetricsLogger(tmp_path, total_steps=4, start_step=1, tensorboard=False, wandb_init=init, wandb_run=run)
    second.log_step({"step": 2, "reward": 0.75})
    second.close()
    assert len(fake.inits) == 1 and fake.finished == 1
    assert [(step, data["train/reward"]) for step, data in fake.logged] == [(1, 0.5), (2, 0.75)]


def test_a_resume_moves_completions_of_redone_steps_aside(tmp_path):
    log = MetricsLogger(tmp_path, total_steps=3, tensorboard=False)
    for step in (1, 2, 3):
        log.log_completions(step, completion_rows())
    log.close()
    MetricsLogger(tmp_path, total_steps=3, start_step=1, tensorboard=False).close()
    kept = [json.loads(x)["step"] for x in (tmp_path / "completions.jsonl").read_text().splitlines()]
    aside = [json.loads(x)["step"] for x in (tmp_path / "completions.jsonl.superseded").read_text().splitlines()]
    assert kept == [1] and aside == [2, 3]


def test_the_progress_line_shows_lengths_and_in_async_runs_staleness(tmp_path, capsys):
    log = MetricsLogger(tmp_path, total_steps=2, tensorboard=False, show_staleness=True)
    log.log_step({"step": 1, "reward_mean": 0.5, "loss": 0.1, "kl": float("nan"), "step_s": 1.0, "staleness": 1,
                  "completions/mean_length": 12.5, "completions/clipped_ratio": 0.25})
    log.close()
    line = capsys.readouterr().out
    assert "len 12.5 (clipped 25%)  stale 1" in line and " kl " not in line  # no KL term: not shown


def test_kl_plot_says_why_it_is_empty_when_beta_is_0(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    notes = []
    real_text = Axes.text
    monkeypatch.setattr(Axes, "text", lambda self, x, y, s, **kw: notes.append(s) or real_text(self, x, y, s, **kw))
    log = MetricsLogger(tmp_path, total_steps=2, tensorboard=False)
    for step in (1, 2):
        log.log_step({"step": step, "reward_mean": 0.5, "kl": float("nan"), "step_s": 1.0})
    log.close()
    plot_run(tmp_path)
    assert len(notes) == 1 and "algo.beta = 0" in notes[0]
    log = MetricsLogger(tmp_path / "b", total_steps=1, tensorboard=False)
    log.log_step({"step": 1, "reward_mean": 0.5, "kl": 0.01, "step_s": 1.0})
    log.close()
    plot_run(tmp_path / "b")
    assert len(notes) == 1  # a run with a KL term gets no note
    (tmp_path / "b" / "config.yaml").write_text("algo: {beta: 0.0}\n")  # the learner reports kl 0.0 at beta = 0
    plot_run(tmp_path / "b")
    assert len(notes) == 2


def test_the_runs_reward_function_keys_are_logged_beside_the_step_keys(tmp_path, capsys):
    keys = ("rewards/gsm8k/mean", "rewards/127.0.0.1_verify/unscorable")
    log = MetricsLogger(tmp_path, 2, tensorboard=False, extra_keys=keys)
    log.log_step({"step": 1, "reward_mean": 0.5, "step_s": 1.0, "loss": 0.1, "kl": 0.0, "rewards/gsm8k/mean": 0.25})
    log.close()
    [row] = read_metrics(tmp_path)
    assert row["rewards/gsm8k/mean"] == 0.25 and row["rewards/127.0.0.1_verify/unscorable"] is None  # NaN -> null
    assert "rewards" not in capsys.readouterr().out  # the console line stays short
    with pytest.raises(ValueError, match="rewards/other/mean"):
        MetricsLogger(tmp_path, 2, tensorboard=False).log_step({"step": 1, "rewards/other/mean": 1.0})


def test_a_resume_restores_rows_the_file_lost_from_the_checkpoints_copy(tmp_path):
    """Issue 30 case 3: a torn last row of a step that has a checkpoint was moved aside and never redone.
    The checkpoint carries the rows of the steps it covers; the raw file ends with every step once."""
    log = MetricsLogger(tmp_path, total_steps=3, tensorboard=False)
    for step in (1, 2):
        log.log_step({"step": step, "reward_mean": 0.1 * step})
    log.log_eval(2, {"accuracy": 0.5})
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    log.save_rows(ckpt, 2)
    log.close()
    path = tmp_path / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[1][:40])  # step 1 lost whole, step 2 torn, the evaluation lost: a power loss
    log = MetricsLogger(tmp_path, total_steps=3, start_step=2, tensorboard=False,
                        carried_rows=read_rows(ckpt / CHECKPOINT_ROWS))
    log.log_step({"step": 3, "reward_mean": 0.3})
    log.close()
    raw = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in raw] == [("train", 1), ("train", 2), ("eval", 2), ("train", 3)]
    assert [json.dumps(r) + "\n" for r in raw[:3]] == [line for line in lines]  # the very rows, restored
    assert (tmp_path / "metrics.jsonl.superseded").read_text() == lines[1][:40] + "\n"


def test_each_row_is_one_whole_write_and_a_full_disk_names_the_file(tmp_path, monkeypatch):
    writes = []
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: writes.append(bytes(data)) or real_write(fd, data))
    log = MetricsLogger(tmp_path, total_steps=1, tensorboard=False)
    log.log_step({"step": 1, "reward_mean": 0.5})
    assert len(writes) == 1 and writes[0].endswith(b"\n") and json.loads(writes[0])["step"] == 1
    log.path = type(log.path)("/dev/full")  # every write: ENOSPC
    with pytest.raises(SaveError, match="could not write /dev/full: the disk is full .* MiB free"):
        log.log_step({"step": 2, "reward_mean": 0.5})


def test_of_a_step_written_twice_the_later_row_stays(tmp_path):
    """A run dir an older raygrpo resumed holds redone steps twice: the later row is the step's (as
    read_metrics reads it); the earlier moves aside."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"kind": "train", "step": s, "reward_mean": r}) + "\n"
                            for s, r in ((1, 0.1), (2, 0.2), (2, 0.25), (3, 0.3))))
    MetricsLogger(tmp_path, total_steps=4, start_step=3, tensorboard=False).close()
    assert [(r["step"], r["reward_mean"]) for r in map(json.loads, path.read_text().splitlines())] == [
        (1, 0.1), (2, 0.25), (3, 0.3)]
    assert json.loads((tmp_path / "metrics.jsonl.superseded").read_text())["reward_mean"] == 0.2


def test_a_resume_names_the_torn_lines_it_moves_aside_and_those_of_the_checkpoints_copy(tmp_path, capsys):
    """Issue 36 case 3 for the resume reader: torn lines of metrics.jsonl, completions.jsonl and the
    checkpoint's copy are counted and named by line number, not dropped silently."""
    row = json.dumps({"kind": "train", "step": 1, "reward_mean": 0.5}) + "\n"
    (tmp_path / "metrics.jsonl").write_text(row + row[:20])
    (tmp_path / "completions.jsonl").write_text('{"step": 1, "compl\n' + json.dumps({"step": 1}) + "\n")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / CHECKPOINT_ROWS).write_text(row + '{"kind": "tr\n')
    carried = ResumePoint(ckpt, {"step": 1}).carried_rows()
    assert [r["step"] for r in carried] == [1]
    MetricsLogger(tmp_path, total_steps=2, start_step=1, tensorboard=False, carried_rows=carried).close()
    out = capsys.readouterr().out
    assert f"{ckpt / CHECKPOINT_ROWS}: skipped 1 torn line(s)" in out and "line(s) 2" in out, out
    assert f"{tmp_path / 'metrics.jsonl'}: moving aside 1 torn line(s)" in out, out
    assert f"{tmp_path / 'completions.jsonl'}: moving aside 1 torn line(s) (not whole JSON rows: a run stopped while " \
           "writing them?): line(s) 1 (to completions.jsonl.superseded)" in out, out


class KeylessWandb(FakeWandb):
    """wandb as it answers without an API key off a terminal (0.31: UsageError from wandb.init)."""

    class errors:  # noqa: N801 - the module's name
        class UsageError(Exception):
            pass

    def init(self, **kw):
        if kw.get("mode") != "offline":
            raise self.errors.UsageError("No API key configured. Use `wandb login` to log in.")
        return super().init(**kw)


def test_without_a_wandb_api_key_the_run_logs_offline_and_says_how_to_upload_it(tmp_path, monkeypatch, capsys):
    fake = KeylessWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    log = MetricsLogger(tmp_path, total_steps=1, tensorboard=False, wandb_init=MetricsConfig(wandb=True).wandb_init())
    log.close()
    assert fake.inits[0]["mode"] == "offline" and fake.inits[0]["dir"] == str(tmp_path)
    err = capsys.readouterr().err
    assert "no W&B API key is configured" in err and f"wandb sync {tmp_path}/wandb/offline-run-*" in err


def test_another_wandb_usage_error_is_not_hidden_by_the_offline_fallback(tmp_path, monkeypatch):
    class BadEntity(KeylessWandb):
        def init(self, **kw):
            raise self.errors.UsageError("entity 'nobody' not found")

    monkeypatch.setitem(sys.modules, "wandb", BadEntity())
    with pytest.raises(BadEntity.errors.UsageError, match="entity"):
        MetricsLogger(tmp_path, total_steps=1, tensorboard=False, wandb_init=MetricsConfig(wandb=True).wandb_init())


def test_a_step_with_no_loss_says_null_on_the_console_as_its_row_does(tmp_path, capsys):
    """Issue 59, item 9: the console showed "loss nan" where metrics.jsonl has null."""
    log = MetricsLogger(tmp_path, total_steps=1, tensorboard=False)
    log.log_step({"step": 1, "reward_mean": float("nan"), "loss": float("nan"), "kl": float("nan"), "step_s": 1.0,
                  "completions/mean_length": 3.0})
    log.close()
    line = capsys.readouterr().out
    assert "reward null" in line and "loss null" in line and "nan" not in line
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert row["loss"] is None and row["reward_mean"] is None


def test_a_reward_function_with_no_values_logs_null_for_its_mean_and_its_std():
    """Issue 59, item 9: `rewards/<name>/std 0.0` was logged beside `mean null`."""
    stats = CollectStats()
    stats.reward_functions = {"none": {"values": [], "errors": 4, "unscorable": 0, "calls": 4, "timeouts": 0,
                                       "seconds": 0.1, "truncated": None, "first_error": "boom"},
                              "one": {"values": [0.5], "errors": 0, "unscorable": 0, "calls": 1, "timeouts": 0,
                                      "seconds": 0.1, "truncated": None, "first_error": None}}
    m = stats.metrics()
    assert math.isnan(m["rewards/none/mean"]) and math.isnan(m["rewards/none/std"])
    assert m["rewards/one/mean"] == 0.5 and m["rewards/one/std"] == 0.0


class OfflineMachineWandb(FakeWandb):
    """wandb online with no network (0.31: wandb.init raises after its init_timeout)."""

    class errors:  # noqa: N801 - the module's name
        class Error(Exception):
            pass

        class UsageError(Error):
            pass

        class CommError(Error):
            pass

        class AuthenticationError(CommError):
            pass

    def init(self, **kw):
        self.inits.append(kw)
        if kw.get("mode") != "offline":
            raise self.errors.CommError("Timed out while retrying (https://api.wandb.ai/graphql). Consider increasing "
                                        "init_timeout")
        return self


def test_wandb_online_with_no_network_logs_offline_after_a_short_wait_naming_wandb_mode_offline(tmp_path, monkeypatch,
                                                                                                 capsys):
    """Issue 59, item 6: W&B online with no network ended the run after ~105 s with wandb's raw "Timed out while
    retrying ... Consider increasing init_timeout"."""
    monkeypatch.delenv("WANDB_INIT_TIMEOUT", raising=False)
    fake = OfflineMachineWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    log = MetricsLogger(tmp_path, total_steps=1, tensorboard=False, wandb_init=MetricsConfig(wandb=True).wandb_init())
    log.close()
    assert fake.inits[0]["settings"] == {"init_timeout": 30.0} and fake.inits[1]["mode"] == "offline"
    err = capsys.readouterr().err
    assert "W&B's server did not answer within 30s" in err and "WANDB_MODE=offline" in err
    assert f"wandb sync {tmp_path}/wandb/offline-run-*" in err
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "120")  # the user's own setting wins
    MetricsLogger(tmp_path / "b", total_steps=1, tensorboard=False, wandb_init=MetricsConfig(wandb=True).wandb_init())
    assert fake.inits[2]["settings"] == {"init_timeout": 120.0}


def test_a_rejected_wandb_key_is_not_hidden_by_the_offline_fallback(tmp_path, monkeypatch):
    class Rejected(OfflineMachineWandb):
        def init(self, **kw):
            raise self.errors.AuthenticationError("API key is invalid")

    monkeypatch.setitem(sys.modules, "wandb", Rejected())
    with pytest.raises(Rejected.errors.AuthenticationError):
        MetricsLogger(tmp_path, total_steps=1, tensorboard=False, wandb_init=MetricsConfig(wandb=True).wandb_init())
