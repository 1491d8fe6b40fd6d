"""A run dir belongs to one run (cluster/run/rundir.py): lock, config continuity, unusable checkpoints."""
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
import yaml
from filelock import SoftFileLease
from filelock._identity import host_name

from cluster.config import load_config, save_config
from cluster.run import rundir
from cluster.run.rundir import HOLDER, LOCK, RunDirError, claim
from learner.export import export_checkpoint


def cfg_for(tmp_path, *overrides):
    m = tmp_path / "model"
    if not m.exists():
        m.mkdir()
        (m / "config.json").write_text("{}")
        header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
        (m / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    return load_config(None, [f"model.path={m}", f"trainer.run_dir={tmp_path / 'run'}", *overrides])


def _holder_process(run_dir, then="import os; os._exit(0)"):
    """Another `raygrpo train`'s claim: a process that takes the run dir's lock, says so, then runs `then`
    (by default it dies without releasing it, as a SIGKILLed run does)."""
    code = (f"import pathlib; from cluster.run.rundir import RunDirClaim; held = RunDirClaim(pathlib.Path({str(run_dir)!r})); "
            f"print('held', flush=True); {then}")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    assert proc.stdout.readline().strip() == "held"
    return proc


def _lease_marker(path, pid, host, *, mode="lease", start=None, duration=None):
    """A lock as filelock writes it (protocol filelock/2), for a holder this test cannot start: another host's,
    or this host's with another start."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["filelock/2", f"pid={pid}", f"host={host}", f"mode={mode}"]
    if mode == "lease":
        lines += ["token=" + "ab" * 16, f"duration={duration if duration is not None else rundir.STALE_AFTER_S!r}"]
    if start is not None:
        lines.append(f"start={start}")
    path.write_text("".join(f"{line}\n" for line in lines))


def test_a_live_holder_refuses_a_second_run_and_a_dead_one_is_taken_over(tmp_path, capsys):
    cfg = cfg_for(tmp_path)
    first = claim(cfg)
    with pytest.raises(RunDirError, match=f"in use by another run: pid {os.getpid()} on host {socket.gethostname()} since "):
        claim(cfg)
    first.release()
    assert not (tmp_path / "run" / LOCK).exists() and not (tmp_path / "run" / HOLDER).exists()
    # a lock left behind by a process that died holding it (os._exit: no release, as after SIGKILL):
    # taken over at once, with a message naming it
    dead = _holder_process(tmp_path / "run")
    dead.wait()
    assert (tmp_path / "run" / LOCK).exists()
    t0 = time.monotonic()
    claim(cfg).release()
    assert time.monotonic() - t0 < rundir.UNREADABLE_WAIT_S  # judged by its pid, not waited out
    assert f"its holder (pid {dead.pid} on host {socket.gethostname()} since " in capsys.readouterr().err


def test_a_lock_whose_pid_now_belongs_to_another_process_is_taken_over(tmp_path, capsys):
    """A restarted container runs the new `raygrpo train` with the old one's hostname and, often, pid:
    the lock records the holder's start, so a pid now held by another process is not the holder."""
    cfg = cfg_for(tmp_path)
    lock = tmp_path / "run" / LOCK
    _lease_marker(lock, os.getpid(), host_name(), start=1)
    claim(cfg).release()  # our own pid, but another start: the holder was a previous incarnation
    assert f"its holder (pid {os.getpid()}" in capsys.readouterr().err

    other = _holder_process(tmp_path / "run", then="import time; time.sleep(60)")
    try:
        with pytest.raises(RunDirError, match=f"in use by another run: pid {other.pid}"):
            claim(cfg)  # that process is the holder
        marker = lock.read_text()
        lock.write_text(re.sub(r"start=\d+", "start=1", marker))
        claim(cfg).release()  # that pid, but another process
        lock.write_text(re.sub(r"start=\d+\n", "", marker))
        with pytest.raises(RunDirError, match="in use by another run"):
            claim(cfg)  # a lock with no start recorded: a live pid is the holder
    finally:
        other.kill()
        other.wait()
    held = claim(cfg)  # and the lock a claim writes carries its start
    assert SoftFileLease(lock).owner.start is not None
    held.release()


def test_an_unreadable_lock_left_by_a_crashed_run_is_taken_over_once_it_stays_unchanged(tmp_path, capsys):
    """A lock half written when its run died, or the JSON lock a raygrpo before filelock wrote: nobody can say
    whose it is, so it is taken over once it has not changed for UNREADABLE_WAIT_S, with a message."""
    cfg = cfg_for(tmp_path)
    lock = tmp_path / "run" / LOCK
    lock.parent.mkdir(parents=True)
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": 1, "since": "2026-11-22 10:00:00"}))
    t0 = time.monotonic()
    claim(cfg).release()
    assert time.monotonic() - t0 > 1.0  # watched, not taken at first sight (it may be being written)
    err = capsys.readouterr().err
    assert f"taking over {lock}" in err and "the lock is unreadable" in err


def test_a_different_config_is_refused_unless_overwrite_which_moves_the_old_run_aside(tmp_path, capsys):
    cfg = cfg_for(tmp_path, "learner.lr=1e-4")
    claim(cfg).release()
    save_config(cfg, tmp_path / "run" / "config.yaml")
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    claim(cfg_for(tmp_path, "learner.lr=1e-4", "trainer.steps=99", "checkpoint.resume=auto")).release()  # continuation
    with pytest.raises(RunDirError, match=r"(?s)learner.lr: 0.0001 -> 0.001.*--overwrite"):
        claim(cfg_for(tmp_path, "learner.lr=1e-3"))
    assert not (tmp_path / "run" / LOCK).exists()  # a refused claim leaves no lock behind
    claim(cfg_for(tmp_path, "learner.lr=1e-3"), overwrite=True).release()
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert len(aside) == 1 and (aside[0] / "metrics.jsonl").exists() and (aside[0] / "config.yaml").exists()
    assert [p.name for p in (tmp_path / "run").iterdir()] == []
    assert "moved the previous contents" in capsys.readouterr().out


def test_a_run_stopped_on_a_fault_continues_with_larger_fault_bounds(tmp_path):
    """Issue 59, item 2: a run that stopped on an engine dead past its budget says "raise rollout.max_restarts
    ... or lower rollout.min_workers" and "run the same command again to resume"; doing both was refused
    ("its config differs: rollout.max_restarts: 0 -> 2"). The bounds on faults may change; the training may not."""
    cfg = cfg_for(tmp_path, "rollout.max_restarts=0", "rollout.num_workers=2", "rollout.min_workers=2")
    claim(cfg).release()
    save_config(cfg, tmp_path / "run" / "config.yaml")
    claim(cfg_for(tmp_path, "rollout.max_restarts=2", "rollout.num_workers=2", "rollout.min_workers=1",
                  "trainer.actor_timeout_s=900", "trainer.max_learner_restarts=3")).release()
    with pytest.raises(RunDirError, match=r"rollout.num_workers: 2 -> 3"):
        claim(cfg_for(tmp_path, "rollout.max_restarts=2", "rollout.num_workers=3", "rollout.min_workers=2"))


def test_checkpoints_that_all_fail_verification_are_listed_never_trained_over(tmp_path):
    cfg = cfg_for(tmp_path)
    root = tmp_path / "run" / "checkpoints"
    (root / "step-00000002").mkdir(parents=True)  # no manifest: the save never finished
    (root / "step-00000004").mkdir()
    (root / "step-00000004" / "COMPLETE").write_text("{not json")
    with pytest.raises(RunDirError) as e:
        claim(cfg)
    text = str(e.value)
    assert "every checkpoint" in text and "step-00000002: " in text and "no COMPLETE marker" in text
    assert "step-00000004" in text and "unreadable manifest" in text
    with pytest.raises(RunDirError, match="checkpoint.resume=none would train from step 0 over the 2 checkpoint"):
        claim(cfg_for(tmp_path, "checkpoint.resume=none"))


def test_export_refuses_a_non_empty_target(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_text("someone's model")
    with pytest.raises(FileExistsError, match="not empty.*--overwrite"):
        export_checkpoint(tmp_path / "any-checkpoint", out)
    assert (out / "model.safetensors").read_text() == "someone's model"


def _foreign_lock(run_dir, *, mode="lease", duration=None):
    """The lock of a run on another host sharing this filesystem, with the note beside it that run wrote."""
    _lease_marker(run_dir / LOCK, 4242, "another-host.example", mode=mode, duration=duration)
    (run_dir / HOLDER).write_text(json.dumps({"host": "another-host.example", "pid": 4242, "since": "2026-11-22 10:00:00",
                                              "command": "raygrpo train"}))


def test_a_live_claim_touches_its_lock_until_released(tmp_path, monkeypatch):
    monkeypatch.setattr(rundir, "HEARTBEAT_S", 0.05)
    lock = claim(cfg_for(tmp_path))
    path = tmp_path / "run" / LOCK
    assert json.loads((tmp_path / "run" / HOLDER).read_text())["pid"] == os.getpid()
    os.utime(path, (1_000_000, 1_000_000))  # long ago
    time.sleep(0.5)
    assert path.stat().st_mtime > 1_000_000  # the heartbeat touched it
    lock.release()
    assert not path.exists() and not (tmp_path / "run" / HOLDER).exists()


def test_a_lock_from_another_host_is_taken_over_only_when_its_heartbeat_stopped(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(rundir, "STALE_AFTER_S", 0.6)
    monkeypatch.setattr(rundir, "HEARTBEAT_S", 0.2)  # filelock wants it below STALE_AFTER_S
    cfg = cfg_for(tmp_path)
    path = tmp_path / "run" / LOCK
    # Alive on another host: its heartbeat keeps touching the lock, so the claim is refused.
    _foreign_lock(tmp_path / "run", duration=0.6)
    stop = threading.Event()

    def beat():
        while not stop.wait(0.05):
            os.utime(path)

    beater = threading.Thread(target=beat)
    beater.start()
    try:
        with pytest.raises(RunDirError, match="in use by another run: pid 4242 on host another-host.example since 2026-11-22"):
            claim(cfg)
    finally:
        stop.set()
        beater.join()
    assert SoftFileLease(path).owner.hostname == "another-host.example"  # left alone
    # Its heartbeat stopped (the run died): taken over after watching it, with a message.
    claim(cfg).release()
    err = capsys.readouterr().err
    assert "watching it for" in err and "has not touched it for" in err
    # A holder that promises no heartbeat (an exclusive lock, not a lease) is never judged by one: refused.
    _foreign_lock(tmp_path / "run", mode="exclusive")
    with pytest.raises(RunDirError, match="delete"):
        claim(cfg)


def test_a_moved_run_dir_is_the_same_run(tmp_path):
    """Issue 30 case 10: the run dir's own path was part of the config check, so a copied or moved run
    dir could only be restarted from step 0 (--overwrite)."""
    cfg = cfg_for(tmp_path)
    claim(cfg).release()
    save_config(cfg, tmp_path / "run" / "config.yaml")
    shutil.move(tmp_path / "run", tmp_path / "moved")
    claim(cfg_for(tmp_path, f"trainer.run_dir={tmp_path / 'moved'}")).release()


def test_a_config_saved_with_relative_paths_matches_the_same_paths_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = cfg_for(tmp_path)
    claim(cfg).release()
    saved = cfg.to_dict()
    saved["model"]["path"] = "model"  # as an older raygrpo saved it: as written, relative to where it ran
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(saved))
    claim(cfg).release()
    saved["model"]["path"] = "another-model"
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(RunDirError, match="model.path"):
        claim(cfg)


def test_a_one_rank_run_dir_saved_at_zero_2_resumes_only_with_the_stage_written_out(tmp_path):
    """learner.zero_stage became auto (0 on one rank): a run dir an older raygrpo made at the old default 2
    is named, not resumed at another stage (DeepSpeed's checkpoint layout differs); with
    learner.zero_stage=2 it continues."""
    cfg = cfg_for(tmp_path)
    claim(cfg).release()
    saved = cfg.to_dict()
    saved["learner"]["zero_stage"] = 2
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(RunDirError, match="learner.zero_stage: 2 -> 0"):
        claim(cfg)
    claim(cfg_for(tmp_path, "learner.zero_stage=2")).release()
