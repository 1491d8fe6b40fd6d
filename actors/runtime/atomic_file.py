"""Replace a file whole: a reader sees the old content or the new one, never a part of either.

The one way raygrpo rewrites a file that someone may read meanwhile (placement.json while a user's tools
poll it, a checkpoint's manifest, metrics.jsonl at a resume, a bench report, a logging config that every
actor reads): the text goes into a temporary file beside the target, named for this process and this
call (several processes may replace the same file at once; the last rename wins), which is then renamed
over the target. `durable=True` also puts the bytes and the rename on the disk before returning, for the
files a power loss must not cut: the checkpoint's and the metrics' (whose rows are each synced as written).
"""
from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path


def replace_text(path: str | os.PathLike, text: str, *, durable: bool = False) -> Path:
    """Write `text` to `path` through a temporary file and a rename; the temporary file never outlives a failure."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if durable:
        sync_dir(path.parent)
    return path


def sync_dir(directory: str | os.PathLike) -> None:
    """Put a directory's entries (a rename into it) on the disk; a no-op where the filesystem refuses."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
