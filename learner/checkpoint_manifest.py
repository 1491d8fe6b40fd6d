"""The checkpoints on disk, read without torch: which `step-*` directories a root holds, and whether one is
complete (the COMPLETE manifest lists every file, its size and, up to a limit, its sha256; the driver's
state file is among them). learner/checkpoint.py writes them.

Apart from checkpoint.py, which imports torch (seconds), because the config check (learner/config.py:
checkpoint.resume) and the CLI's run-dir check (cluster/run/rundir.py) read them and must stay quick.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

MANIFEST = "COMPLETE"
DRIVER_STATE = "driver_state.json"
_STEP_RE = re.compile(r"^step-(\d{8,})$")


def verify(path: str | os.PathLike) -> list[str]:
    """Problems with the checkpoint at `path` ([] = complete and intact)."""
    path = Path(path)
    if not path.is_dir():
        return [f"{path}: no such checkpoint directory"]
    mpath = path / MANIFEST
    if not mpath.is_file():
        return [f"{path}: no {MANIFEST} marker (the save did not finish)"]
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as e:
        return [f"{mpath}: unreadable manifest ({e})"]
    problems = []
    for rel, entry in files.items():
        f = path / rel
        if not f.is_file():
            problems.append(f"{f}: missing")
        elif f.stat().st_size != entry["size"]:
            problems.append(f"{f}: size {f.stat().st_size} != {entry['size']} in the manifest")
        elif "sha256" in entry and _sha256(f) != entry["sha256"]:
            problems.append(f"{f}: sha256 differs from the manifest")
    if DRIVER_STATE not in files:
        problems.append(f"{path}: the manifest does not list {DRIVER_STATE}")
    return problems


def _sha256(f: Path) -> str:
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def list_checkpoints(root: str | os.PathLike) -> list[str]:
    """All `step-*` directories under root, oldest first (complete or not)."""
    return [str(p) for _, p in _step_dirs(Path(root))]


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    out = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_RE.match(p.name))]
    return sorted(out)
