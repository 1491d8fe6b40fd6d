"""Whether an exported HF model directory is whole: a run stopped during its final export (the driver
killed, a power loss) can leave `hf_model/` with its config but no weights, or a weights file cut
short. A rerun of the finished run checks this (cluster/run/resume.py) and exports again.

And whether a model directory still holds the weights a run trained from (`weights_fingerprint`): a
checkpoint carries model.path's fingerprint, because a resume and a LoRA export take weights from there.
"""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

INDEX = "model.safetensors.index.json"
BASE_WEIGHTS = "base_weights.json"  # in a checkpoint's hf-config/: model.path's weights_fingerprint as rank 0 loaded it
WEIGHT_FILES = ("*.safetensors", "*.bin")  # an HF directory's weights (safetensors, or PyTorch's pickles)
SAMPLES, SAMPLE_BYTES = 64, 1 << 16


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


def weights_fingerprint(model_dir: str | Path) -> dict[str, dict]:
    """Each weight file of an HF model directory with its size and the sha256 of 64 evenly spaced 64 KiB
    samples of it (the whole file when smaller): 4 MiB read a file, however large. A different model of the
    same architecture, or another fine-tune of this one, differs in nearly every sample; a copy of the
    directory does not differ at all."""
    out = {}
    for f in sorted(p for pattern in WEIGHT_FILES for p in Path(model_dir).glob(pattern)):
        size = f.stat().st_size
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for offset in range(0, size, max(size // SAMPLES, SAMPLE_BYTES)):
                fh.seek(offset)
                h.update(fh.read(SAMPLE_BYTES))
        out[f.name] = {"size": size, "sampled_sha256": h.hexdigest()}
    return out


def fingerprint_differences(saved: dict, now: dict) -> list[str]:
    """How the weight files `now` differ from the `saved` fingerprint ([] = the same weights)."""
    diffs = []
    for name in sorted(set(saved) | set(now)):
        if name not in now:
            diffs.append(f"{name} is gone")
        elif name not in saved:
            diffs.append(f"{name} is new")
        elif saved[name]["size"] != now[name]["size"]:
            diffs.append(f"{name} is {now[name]['size']:,} bytes, was {saved[name]['size']:,}")
        elif saved[name]["sampled_sha256"] != now[name]["sampled_sha256"]:
            diffs.append(f"{name} holds other weights")
    return diffs


def base_weights_problem(ckpt: str | Path, meta_dir: str, model_dir: str | Path) -> str | None:
    """How `model_dir`'s weights differ from those the checkpoint's run trained from (its hf-config/ holds
    their fingerprint), or None: the same, or a checkpoint saved before fingerprints were."""
    saved = Path(ckpt) / meta_dir / BASE_WEIGHTS
    if not saved.is_file():
        return None
    diffs = fingerprint_differences(json.loads(saved.read_text()), weights_fingerprint(model_dir))
    return f"{model_dir} no longer holds the weights the run trained from ({'; '.join(diffs)})" if diffs else None
