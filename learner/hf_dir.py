"""Whether an exported HF model directory is whole: a run stopped during its final export (the driver
killed, a power loss) can leave `hf_model/` with its config but no weights, or a weights file cut
short. A rerun of the finished run checks this (cluster/run/resume.py) and exports again.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

INDEX = "model.safetensors.index.json"


def safetensors_problem(path: Path) -> str | None:
    """Why `path` is not a whole safetensors file (its header unreadable, or shorter than its header
    says), or None."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path} is cut short ({len(head)} bytes)"
            (n,) = struct.unpack("<Q", head)
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        size = path.stat().st_size
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        return f"{path} is not a readable safetensors file ({type(e).__name__}: {e})"
    if size < 8 + n + end:
        return f"{path} is cut short ({size} of {8 + n + end} bytes)"
    return None


def hf_dir_problem(path: str | Path) -> str | None:
    """Why the HF model directory `path` is not whole (missing, no config, weights missing or cut short,
    a shard of its index missing), or None when it is."""
    d = Path(path)
    if not (d / "config.json").is_file():
        return f"{d} has no config.json"
    if (d / INDEX).is_file():
        try:
            shards = sorted(set(json.loads((d / INDEX).read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError) as e:
            return f"{d / INDEX} is unreadable ({type(e).__name__}: {e})"
    elif (d / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        return f"{d} has no weights (model.safetensors)"
    for shard in shards:
        if not (d / shard).is_file():
            return f"{d / shard} is missing"
        problem = safetensors_problem(d / shard)
        if problem:
            return problem
    for adapter in sorted((d / "adapter").glob("*.safetensors")) if (d / "adapter").is_dir() else ():
        problem = safetensors_problem(adapter)
        if problem:
            return problem
    return None
