"""A run dir belongs to one run: claimed with a lock, checked against what is already there.

`claim(cfg, overwrite)` runs before any actor starts and refuses, with a message saying what to do:
- a run dir another live `raygrpo train` holds (lock file `raygrpo.lock`: host, pid and the process's
  start time; a lock left by a dead process on this host is taken over, with a message, also when
  its pid now belongs to another process (a restarted container gives the new run the same pid
  and hostname); so is one from another host
  (a shared filesystem) whose holder stopped touching it: a holder touches its lock every
  `HEARTBEAT_S`, and a claimant watches the file's mtime, never its own clock, for `STALE_AFTER_S`);
- a run dir whose saved config.yaml differs from this run's in anything but `trainer.steps`,
  `checkpoint.resume` and `trainer.run_dir` (continuing a run with other settings would mix two runs in
  one record; a run dir moved or copied elsewhere is still the same run);
- a run dir whose checkpoints all fail verification (resuming would restart from step 0 over
  them), or `checkpoint.resume=none` on a run dir that holds checkpoints.
`overwrite=True` (`raygrpo train --overwrite`) starts afresh instead: the old contents are moved
to a sibling `RUN_DIR.replaced-<time>` directory; nothing is deleted.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import threading
import time
from pathlib import Path

import psutil
import yaml

from cluster.paths import absolute_paths
from learner.checkpoint_manifest import list_checkpoints, verify

LOCK = "raygrpo.lock"
HEARTBEAT_S = 10.0  # how often a holder touches its lock
STALE_AFTER_S = 35.0  # a lock from another host untouched this long (watched, not compared with our clock) is stale
# what may change between a run and its continuation in the same run dir; trainer.run_dir too: the dir
# itself, moved or copied elsewhere, is still the same run
CONTINUATION_KEYS = {"trainer.steps", "checkpoint.resume", "trainer.run_dir"}


class RunDirError(ValueError):
    """The run dir cannot be used by this run as it is (bad input: the CLI exits 2)."""


class RunDirClaim:
    """The lock on a run dir, held until `release()`."""

    def __init__(self, run_dir: Path):
        self.run_dir, self.lock = run_dir, run_dir / LOCK
        self.lock.parent.mkdir(parents=True, exist_ok=True)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": _start_time(os.getpid()),
              "since": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv), "heartbeat_s": HEARTBEAT_S}
        self._stop = threading.Event()
        for _ in range(20):
            try:
                fd = os.open(self.lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._handle_held(me)
                continue
            with os.fdopen(fd, "w") as fh:
                json.dump(me, fh)
            threading.Thread(target=self._heartbeat, args=(me,), daemon=True, name="run-dir-lock-heartbeat").start()
            return
        raise RunDirError(f"could not take the lock {self.lock}: it keeps changing hands")

    def _heartbeat(self, me: dict) -> None:
        """Touch the lock while it is ours: what another host's claimant watches (`_watch`)."""
        while not self._stop.wait(HEARTBEAT_S):
            if _read_lock(self.lock) != me:
                return
            try:
                os.utime(self.lock)
            except OSError:
                return

    def _handle_held(self, me: dict) -> None:
        holder = _read_lock(self.lock)
        if holder is None:  # being written right now by another process, or an empty leftover
            time.sleep(0.2)
            holder = _read_lock(self.lock)
            if holder is None:
                if self.lock.exists() and time.time() - self.lock.stat().st_mtime > 5:
                    print(f"taking over {self.lock}: unreadable lock file left by a crashed run", file=sys.stderr)
                    self.lock.unlink(missing_ok=True)
                return
        if holder.get("host") == me["host"] and not _alive(holder.get("pid", -1), holder.get("started")):
            self._take_over(holder, "is gone")
            return
        if holder.get("host") != me["host"] and "heartbeat_s" in holder:
            verdict = self._watch(holder)
            if verdict == "changed":  # released or taken meanwhile: try again
                return
            if verdict == "stale":
                self._take_over(holder, f"has not touched it for {STALE_AFTER_S:.0f}s")
                return
        raise RunDirError(
            f"run dir {self.run_dir} is in use by another run: pid {holder.get('pid')} on host {holder.get('host')} "
            f"since {holder.get('since')} ({holder.get('command', '?')}). Wait for it to finish or stop it, or use "
            f"another trainer.run_dir. If that process is really gone (another host), delete {self.lock}.")

    def _take_over(self, holder: dict, why: str) -> None:
        """Remove the lock `holder` left (the caller then claims it), saying so."""
        print(f"taking over {self.lock}: its holder (pid {holder.get('pid')} on {holder.get('host')}, "
              f"since {holder.get('since')}) {why}", file=sys.stderr)
        if _read_lock(self.lock) == holder:  # not already taken over by someone else
            self.lock.unlink(missing_ok=True)

    def _watch(self, holder: dict) -> str:
        """Whether another host's holder is alive: "alive" if it touches the lock within
        STALE_AFTER_S, "stale" if the lock's mtime stays the same that long, "changed" if the lock
        is released or replaced meanwhile. Only mtimes are compared, so clock skew between hosts
        does not matter."""
        print(f"{self.lock} is held by pid {holder.get('pid')} on {holder.get('host')}; watching it for "
              f"{STALE_AFTER_S:.0f}s to see whether that run is alive (a live run touches it every "
              f"{holder['heartbeat_s']}s)", file=sys.stderr)
        try:
            first = self.lock.stat().st_mtime_ns
        except FileNotFoundError:
            return "changed"
        deadline = time.monotonic() + STALE_AFTER_S
        while time.monotonic() < deadline:
            time.sleep(min(1.0, STALE_AFTER_S / 10))
            try:
                mtime = self.lock.stat().st_mtime_ns
            except FileNotFoundError:
                return "changed"
            if _read_lock(self.lock) != holder:
                return "changed"
            if mtime != first:
                return "alive"
        return "stale"

    def release(self) -> None:
        self._stop.set()
        holder = _read_lock(self.lock)
        if holder is not None and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            self.lock.unlink(missing_ok=True)


def _read_lock(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def _start_time(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch, 10 ms ticks); None if it cannot be read."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _alive(pid, started: float | None = None) -> bool:
    """Whether the process that wrote a lock on this host still runs: `pid` exists and, when the
    lock recorded it (`started`; older locks did not), started at that time, so a reused pid does not count."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    if isinstance(started, (int, float)):
        now = _start_time(pid)
        return now is None or abs(now - started) < 0.05  # unreadable: assume it is the holder
    return True


def claim(cfg, overwrite: bool = False) -> RunDirClaim:
    """Lock `cfg.trainer.run_dir` for this run and check that continuing in it loses nothing."""
    run_dir = Path(cfg.trainer.run_dir)
    lock = RunDirClaim(run_dir)
    try:
        previous = [p for p in run_dir.iterdir() if p.name != LOCK]
        if overwrite and previous:
            aside = run_dir.with_name(f"{run_dir.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
            aside.mkdir(parents=True)
            for p in previous:
                shutil.move(str(p), aside / p.name)
            print(f"--overwrite: moved the previous contents of {run_dir} to {aside}; starting afresh", flush=True)
            return lock
        problems = config_differences(run_dir / "config.yaml", cfg.to_dict())
        ckpts = list_checkpoints(run_dir / "checkpoints")
        resume = cfg.checkpoint.resume
        if ckpts and resume == "none":
            problems.append(f"checkpoint.resume=none would train from step 0 over the {len(ckpts)} checkpoint(s) in "
                            f"{run_dir / 'checkpoints'}")
        elif ckpts and resume == "auto" and all(failed := [verify(p) for p in ckpts]):
            listing = "\n".join(f"    {p}: {'; '.join(f[:3])}" for p, f in zip(ckpts, failed))
            problems.append(f"every checkpoint in {run_dir / 'checkpoints'} fails verification (resuming would "
                            f"restart from step 0 over them):\n{listing}")
        if problems:
            raise RunDirError(
                f"run dir {run_dir} holds a run this one cannot continue:\n  - " + "\n  - ".join(problems) +
                f"\nUse another trainer.run_dir, or pass --overwrite to `raygrpo train` to move the old contents "
                f"aside ({run_dir.name}.replaced-<time>) and start afresh.")
    except BaseException:
        lock.release()
        raise
    return lock


def config_differences(saved_path: Path, new: dict) -> list[str]:
    """'key: old -> new' for each setting that differs from the saved config, except CONTINUATION_KEYS.
    Keys the saved file does not have (written by an older raygrpo) are not compared."""
    if not saved_path.is_file():
        return []
    try:
        old = yaml.safe_load(saved_path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        return [f"{saved_path} is unreadable ({e})"]
    # A config saved by an older raygrpo holds paths as written (relative): compare them made absolute
    # from here, as this run's are.
    old_flat, new_flat = _flatten(absolute_paths(old) if isinstance(old, dict) else {}), _flatten(new)
    diffs = [f"{k}: {old_flat[k]!r} -> {v!r}" for k, v in new_flat.items()
             if k in old_flat and k not in CONTINUATION_KEYS and old_flat[k] != v]
    return [f"its config ({saved_path}) differs from this run's: " + ", ".join(diffs)] if diffs else []


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= _flatten(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out
