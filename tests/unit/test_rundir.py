"""A run dir belongs to one run (cluster/run/rundir.py): lock, config continuity, unusable checkpoints."""
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time

import psutil
import pytest
import yaml

from cluster.config import load_config, save_config
from cluster.run import rundir
from cluster.run.rundir import LOCK, RunDirError, claim
from learner.export import export_checkpoint


def cfg_for(tmp_path, *overrides):
    m = tmp_path / "model"
    if not m.exists():
        m.mkdir()
        (m / "config.json").write_text("{}")
        header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
        (m / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    return load_config(None, [f"model.path={m}", f"trainer.run_dir={tmp_path / 'run'}", *overrides])


def test_a_live_holder_refuses_a_second_run_and_a_dead_one_is_taken_over(tmp_path, capsys):
    cfg = cfg_for(tmp_path)
    first = claim(cfg)
    with pytest.raises(RunDirError, match=f"in use by another run: pid {__import__('os').getpid()}"):
        claim(cfg)
    first.release()
    assert not (tmp_path / "run" / LOCK).exists()
    # a lock left behind by a process that died (SIGKILL): taken over with a message
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "run" / LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout)}))
    claim(cfg).release()
    assert f"its holder (pid {int(dead.stdout)}" in capsys.readouterr().err


def test_a_lock_whose_pid_now_belongs_to_another_process_is_taken_over(tmp_path, capsys):
    """A restarted container runs the new `raygrpo train` with the old one's hostname and, often, pid:
    the lock records the holder's start time, so a pid now held by another process is not the holder."""
    cfg = cfg_for(tmp_path)
    lock = tmp_path / "run" / LOCK
    lock.parent.mkdir(parents=True, exist_ok=True)
    me = psutil.Process().create_time()
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": me - 120.0}))
    claim(cfg).release()  # our own pid, but we started later: the holder was a previous incarnation
    assert f"its holder (pid {os.getpid()}" in capsys.readouterr().err

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = psutil.Process(other.pid).create_time()
        lock.write_text(json.dumps({"host": socket.gethostname(), "pid": other.pid, "started": started}))
        with pytest.raises(RunDirError, match=f"in use by another run: pid {other.pid}"):
            claim(cfg)  # that process is the holder
        lock.write_text(json.dumps({"host": socket.gethostname(), "pid": other.pid, "started": started - 3600}))
        claim(cfg).release()  # that pid, but another process
        lock.write_text(json.dumps({"host": socket.gethostname(), "pid": other.pid}))
        with pytest.raises(RunDirError, match="in use by another run"):
            claim(cfg)  # a lock of an older raygrpo (no start time): a live pid is the holder, as before
    finally:
        other.kill()
        other.wait()
    held = claim(cfg)  # and the lock a claim writes carries its start time
    assert json.loads(lock.read_text())["started"] == me
    held.release()


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


def _foreign_lock(path, **extra):
    path.parent.mkdir(parents=True, exist_ok=True)
    holder = {"host": "another-host.example", "pid": 4242, "since": "2026-11-22 10:00:00", "command": "raygrpo train",
              **extra}
    path.write_text(json.dumps(holder))
    return holder


def test_a_live_claim_touches_its_lock_until_released(tmp_path, monkeypatch):
    monkeypatch.setattr(rundir, "HEARTBEAT_S", 0.05)
    lock = claim(cfg_for(tmp_path))
    path = tmp_path / "run" / LOCK
    assert json.loads(path.read_text())["heartbeat_s"] == 0.05
    os.utime(path, (1_000_000, 1_000_000))  # long ago
    time.sleep(0.5)
    assert path.stat().st_mtime > 1_000_000  # the heartbeat touched it
    lock.release()
    assert not path.exists()


def test_a_lock_from_another_host_is_taken_over_only_when_its_heartbeat_stopped(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(rundir, "STALE_AFTER_S", 0.6)
    cfg = cfg_for(tmp_path)
    path = tmp_path / "run" / LOCK
    # Alive on another host: its heartbeat keeps touching the lock, so the claim is refused.
    _foreign_lock(path, heartbeat_s=0.05)
    stop = threading.Event()

    def beat():
        while not stop.wait(0.05):
            os.utime(path)

    beater = threading.Thread(target=beat)
    beater.start()
    try:
        with pytest.raises(RunDirError, match="in use by another run: pid 4242 on host another-host.example"):
            claim(cfg)
    finally:
        stop.set()
        beater.join()
    assert json.loads(path.read_text())["host"] == "another-host.example"  # left alone
    # Its heartbeat stopped (the run died): taken over after watching it, with a message.
    claim(cfg).release()
    err = capsys.readouterr().err
    assert "watching it for" in err and "has not touched it for" in err
    # A holder that declares no heartbeat (an older raygrpo) is never judged by one: refused as before.
    _foreign_lock(path)
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
