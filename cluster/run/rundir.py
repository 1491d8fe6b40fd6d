"""A run dir belongs to one run: claimed with a lock, checked against what is already there.

`claim(cfg, overwrite)` runs before any actor starts and refuses, with a message saying what to do:
- a run dir another live `raygrpo train` holds (lock file `raygrpo.lock`, a `filelock.SoftFileLease`:
  host, pid and the process's start; `raygrpo.lock.holder` beside it says since when and which command).
  A lock left by a dead process on this host is taken over, with a message, also when its pid now
  belongs to another process (a restarted container gives the new run the same pid and hostname); so is
  one from another host (a shared filesystem) whose holder stopped touching it: a holder touches its
  lock every `HEARTBEAT_S`, and a claimant watches the file, never comparing clocks, for `STALE_AFTER_S`;
- a run dir whose saved config.yaml differs from this run's in anything but CONTINUATION_KEYS (`trainer.steps`,
  `checkpoint.resume`, `trainer.run_dir` and the bounds on faults): continuing a run with other settings would
  mix two runs in one record; a run dir moved or copied elsewhere is still the same run;
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
import time
from pathlib import Path

import yaml
from filelock import LeaseSettingsMismatch, OwnerRecord, SoftFileLease, Timeout

# filelock writes its own host names into the lock (a container's pid namespace appended), and exports no
# public way to get this host's: compared against to tell "gone from this host" from "another host".
from filelock._identity import host_name

from cluster.paths import absolute_paths
from learner.checkpoint_manifest import list_checkpoints, verify

LOCK = "raygrpo.lock"
HOLDER = "raygrpo.lock.holder"  # since when and which command hold LOCK: for the message a second run gets
HEARTBEAT_S = 10.0  # how often a holder touches its lock
STALE_AFTER_S = 35.0  # a lock from another host untouched this long (watched, not compared with our clock) is stale
# filelock takes over an unreadable lock (half written, or written by a raygrpo before filelock) once it has
# seen it unchanged for 2 s (filelock._soft.MALFORMED_LOCK_AGE_THRESHOLD); a claimant waits that long and a little
UNREADABLE_WAIT_S = 3.0
# what may change between a run and its continuation in the same run dir; trainer.run_dir too: the dir
# itself, moved or copied elsewhere, is still the same run. And the bounds on faults, which decide whether a
# run survives a fault, not what it trains: a run that stopped on one says to raise rollout.max_restarts, lower
# rollout.min_workers or raise trainer.actor_timeout_s and run again, which resumes (issue 59, item 2)
CONTINUATION_KEYS = {"trainer.steps", "checkpoint.resume", "trainer.run_dir", "rollout.max_restarts",
                     "rollout.min_workers", "trainer.actor_timeout_s", "trainer.max_learner_restarts"}


class RunDirError(ValueError):
    """The run dir cannot be used by this run as it is (bad input: the CLI exits 2)."""


class RunDirClaim:
    """The lock on a run dir, held until `release()`: a `filelock.SoftFileLease` on `LOCK`.

    filelock writes the holder's host, pid and process start into the lock, takes over at once a lock
    whose holder on this host is gone (a reused pid does not count: the start must match), and, for a
    holder on another host (a shared filesystem), touches the lock every `HEARTBEAT_S` and lets a
    claimant take it only once it has seen it untouched for `STALE_AFTER_S` on its own clock. What the
    lock file cannot hold for the message (since when, which command) is written beside it, in `HOLDER`.
    """

    def __init__(self, run_dir: Path):
        self.run_dir, self.lock, self.about = run_dir, run_dir / LOCK, run_dir / HOLDER
        run_dir.mkdir(parents=True, exist_ok=True)
        self._lease = SoftFileLease(self.lock, lease_duration=STALE_AFTER_S, heartbeat_interval=HEARTBEAT_S)
        existed, before, about = self.lock.exists(), self._lease.owner, _read_json(self.about)
        try:
            self._lease.acquire(timeout=0)
        except Timeout:
            self._wait_for_a_stale_holder(about)
        except LeaseSettingsMismatch as e:  # a raygrpo with other HEARTBEAT_S / STALE_AFTER_S holds it
            raise RunDirError(f"run dir {run_dir} is locked by a raygrpo that judges its lock otherwise ({e}); "
                              f"wait for that run to finish, or use another trainer.run_dir") from None
        if existed:  # filelock took over a lock left behind: say whose
            gone = "is gone" if before is None or before.hostname == host_name() else \
                f"has not touched it for {STALE_AFTER_S:.0f}s"
            print(f"taking over {self.lock}: its holder ({_describe(before, about)}) {gone}", file=sys.stderr)
        self._me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "command": " ".join(sys.argv)}
        self.about.write_text(json.dumps(self._me))

    def _wait_for_a_stale_holder(self, about: dict | None) -> None:
        """The lock is taken: wait as long as filelock needs to judge a holder that may be gone, else refuse.
        A lease from another host is stale once untouched for STALE_AFTER_S; an unreadable lock (being
        written, or one a raygrpo before filelock wrote) once unchanged for UNREADABLE_WAIT_S."""
        holder = self._lease.owner
        if holder is None:
            wait = UNREADABLE_WAIT_S
        elif holder.mode == "lease" and holder.hostname != host_name():
            wait = STALE_AFTER_S + 1.0
            print(f"{self.lock} is held by {_describe(holder, about)}; watching it for {STALE_AFTER_S:.0f}s to see "
                  f"whether that run is alive (a live run touches it every {HEARTBEAT_S}s)", file=sys.stderr)
        else:  # a live process on this host, or a holder on another host that promised no heartbeat
            wait = 0.0
        try:
            self._lease.acquire(timeout=wait, poll_interval=min(0.5, STALE_AFTER_S / 10))
        except Timeout:
            holder = self._lease.owner
            raise RunDirError(
                f"run dir {self.run_dir} is in use by another run: {_describe(holder, _read_json(self.about))}. "
                f"Wait for it to finish or stop it, or use another trainer.run_dir. If that process is really gone "
                f"(another host), delete {self.lock}.") from None

    def release(self) -> None:
        if self._lease.is_locked:
            if _read_json(self.about) == self._me:
                self.about.unlink(missing_ok=True)
            self._lease.release()


def _describe(holder: OwnerRecord | None, about: dict | None) -> str:
    """'pid P on host H since S (command)' for the message, from the lock and the HOLDER file beside it."""
    if holder is None:
        return "unknown: the lock is unreadable, left by a crashed run or a raygrpo before filelock"
    if about and about.get("pid") == holder.pid:
        return (f"pid {holder.pid} on host {about.get('host')} since {about.get('since')} "
                f"({about.get('command', '?')})")
    return f"pid {holder.pid} on host {holder.hostname}"


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def claim(cfg, overwrite: bool = False) -> RunDirClaim:
    """Lock `cfg.trainer.run_dir` for this run and check that continuing in it loses nothing."""
    run_dir = Path(cfg.trainer.run_dir)
    lock = RunDirClaim(run_dir)
    try:
        previous = [p for p in run_dir.iterdir() if p.name not in (LOCK, HOLDER)]
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
