"""Read a W&B offline run back from its files (RUN_DIR/wandb/offline-run-*/): the run record (name,
config), the history rows, the media files. wandb 0.31 keeps all of it in one transaction log,
run-<id>.wandb, whose framing is LevelDB's log format under a 7-byte ":W&B" header, each record a
wandb_internal.proto Record; no reader of it ships in the Python package (its Go core writes it)."""
from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768  # LevelDB log blocks; a record's 7-byte header never straddles one
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, _magic, _version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B", f"{path} is not a W&B transaction log (header {ident!r})"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == FULL:
            yield pb.Record.FromString(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pb.Record.FromString(pending + chunk)
            pending = b""


def read_offline_run(run_dir: Path) -> dict:
    """{"dir", "name", "project", "config" (key -> value), "history" (one dict per wandb.log call)}."""
    dirs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(dirs) == 1, f"expected one offline run under {run_dir}/wandb, found {dirs}"
    (log,) = dirs[0].glob("run-*.wandb")
    out = {"dir": dirs[0], "name": None, "project": None, "config": {}, "history": []}
    for rec in records(log):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out["name"], out["project"] = rec.run.display_name, rec.run.project
            out["config"] |= {u.key: json.loads(u.value_json) for u in rec.run.config.update}
        elif kind == "config":
            out["config"] |= {u.key: json.loads(u.value_json) for u in rec.config.update}
        elif kind == "history":
            row: dict = {}
            for item in rec.history.item:
                keys = list(item.nested_key) or [item.key]
                node = row
                for k in keys[:-1]:
                    node = node.setdefault(k, {})
                node[keys[-1]] = json.loads(item.value_json)
            out["history"].append(row)
    return out
