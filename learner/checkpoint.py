"""Checkpoints: an atomic directory per step, verified on resume (learner/export.py turns one
into a plain HF model).

Layout of one checkpoint (`root/step-00000010`):
    learner/                 DeepSpeed's files (model, optimizer, LR schedule; tag = LEARNER_TAG)
    learner/raygrpo_rank_00000.json   each rank's RNG states and counters
    hf-config/               config + tokenizer of the model (so `export` needs nothing else)
    driver_state.json        the driver's step, weight version, data position, RNG, config
    next_batch.safetensors   async only: the next step's batch, already collected (cluster/driver/batch.py
    next_batch.json            save_batch), so a resume trains on it as the run that never stopped does
    COMPLETE                 manifest: every file with its size (+ sha256 when small); written last

Protocol (the driver's side):
    tmp = begin(root, step)                     -> root/.tmp-step-00000010
    every LearnerWorker.save_checkpoint(tmp, LEARNER_TAG)
    final = commit(tmp, root, step, driver_state, keep)   manifest, rename, prune
    path = latest_complete(root)                newest checkpoint whose manifest verifies
A crash at any point leaves either no new `step-*` directory or a complete one; a checkpoint
that fails verification (truncated, edited, half-deleted) is skipped with a warning.

Safety: nothing here unpickles. JSON for our state, safetensors for exported weights, and
DeepSpeed's own torch.save files are read with `torch.load(weights_only=True)` (see
`safe_torch_load`; DeepSpeed 0.19.8 itself passes weights_only=False everywhere).
"""
from __future__ import annotations

import base64
import contextlib
import errno
import json
import logging
import os
import random
import re
import shutil
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from actors.runtime.atomic_file import replace_text, sync_dir
from learner.checkpoint_manifest import DRIVER_STATE, MANIFEST, _sha256, _step_dirs, verify
from learner.checkpoint_manifest import list_checkpoints as list_checkpoints  # its callers read it here too

log = logging.getLogger(__name__)

LEARNER_TAG = "learner"
HF_META_DIR = "hf-config"
ADAPTER_DIR = "adapter"  # LoRA runs: the adapter in peft format (export merges it into the base model)
FORMAT_VERSION = 1
HASH_LIMIT = 64 * 2**20  # sha256 of files up to this size; larger ones are checked by size only
_TMP_RE = re.compile(r"^\.tmp-step-(\d{8,})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def final_path(path: str | os.PathLike) -> str:
    """Where a checkpoint being written to `path` ends up once committed (`path` itself if it is
    not a temporary directory of begin())."""
    p = Path(path)
    m = _TMP_RE.match(p.name)
    return str(p.with_name(step_dir_name(int(m.group(1))))) if m else str(p)


# --------------------------------------------------------------------------- #
# the driver's side: begin / commit / latest_complete / load_driver_state
# --------------------------------------------------------------------------- #
def begin(root: str | os.PathLike, step: int) -> str:
    """A fresh, empty temporary directory for the checkpoint of `step` (a stale one is removed)."""
    tmp = Path(root) / f".tmp-{step_dir_name(step)}"
    with naming_save_errors(tmp):
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    return str(tmp)


def commit(tmp_dir: str | os.PathLike, root: str | os.PathLike, step: int, driver_state: dict, keep: int) -> str:
    """Seal the checkpoint the workers wrote into `tmp_dir`: driver_state.json, the COMPLETE manifest,
    an atomic rename to root/step-NNNNNNNN, then keep only the newest `keep` complete checkpoints."""
    tmp, root = Path(tmp_dir), Path(root)
    final = Path(final_path(tmp))
    if final.parent.resolve() != root.resolve() or final.name != step_dir_name(step):
        raise ValueError(f"{tmp} is not the temporary directory begin({str(root)!r}, {step}) returns")
    state = {"step": step, **driver_state}
    match_umask(tmp)  # the weights too (safetensors writes 0600); before the manifest, which lists sizes only
    with naming_save_errors(tmp):
        _write_json_atomic(tmp / DRIVER_STATE, state)  # raises on non-JSON-able data, before anything is sealed
        manifest = {"format": FORMAT_VERSION, "step": step, "created": time.time(), "files": _list_files(tmp)}
        _write_json_atomic(tmp / MANIFEST, manifest)
    sync_dir(tmp)
    if final.exists():  # the same step saved again (e.g. a resumed run): the new one wins
        old = root / f".old-{final.name}-{os.getpid()}"
        os.replace(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, final)
    sync_dir(root)
    prune(root, keep, protect=final)
    return str(final)


def prune(root: str | os.PathLike, keep: int, protect: str | os.PathLike | None = None) -> list[str]:
    """Delete all but the newest `keep` intact checkpoints (never `protect`, the one just written),
    and every temporary/leftover directory. Checkpoints that fail verification are left alone:
    latest_complete skips them with a warning, and a person may want to look at them."""
    root = Path(root)
    protect = Path(protect).resolve() if protect is not None else None
    removed = []
    intact = [p for _, p in _step_dirs(root) if not verify(p)]
    others = [p for p in intact if p.resolve() != protect]
    room = keep - (len(others) < len(intact))  # the protected one takes one of the `keep` places
    for p in others[: max(0, len(others) - room)]:
        shutil.rmtree(p, ignore_errors=True)
        removed.append(str(p))
    for p in root.iterdir() if root.exists() else []:
        if p.is_dir() and (_TMP_RE.match(p.name) or p.name.startswith(".old-step-")):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(str(p))
    return removed


class SaveError(OSError):
    """Writing a checkpoint or model failed; the message names the path and the likely cause."""


@contextlib.contextmanager
def naming_save_errors(path: str | os.PathLike, kept: str = "the last complete checkpoint is kept"):
    """Turn a failed write under `path` into an error that names it, the cause, the free space there and
    what is kept (`kept`). torch.save on a full disk says only "unexpected pos 4004224 vs 4004112" (a
    RuntimeError), DeepSpeed adds no path, and TensorBoard's writer thread prints 40 lines without one."""
    try:
        yield
    except (OSError, RuntimeError) as e:
        if isinstance(e, SaveError):
            raise
        if not isinstance(e, OSError) and "unexpected pos" not in str(e) and "failed writing" not in str(e):
            raise
        where = Path(path)
        probe = next((p for p in [where, *where.parents] if p.exists()), Path("/"))
        try:
            free = f"{shutil.disk_usage(probe).free / 2**20:.0f} MiB free on that filesystem"
        except OSError:
            free = "free space unknown"
        cause = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
                 errno.EACCES: "no permission to write there", errno.EROFS: "the filesystem is read-only",
                 errno.EPERM: "no permission to write there"}.get(getattr(e, "errno", None), "")
        if not cause and not isinstance(e, OSError):
            cause = "a write was cut short (disk full?)"
        raise SaveError(getattr(e, "errno", None) or errno.EIO,
                        f"could not write {where}: {cause or type(e).__name__} ({e}); {free}. Free space or fix "
                        f"permissions there (or point trainer.run_dir elsewhere); {kept}") from e


@contextlib.contextmanager
def without_zip_crc32():
    """torch.save without the CRC32 of each record in its zip file, inside the block. torch computes it at
    about 70 MB/s on the 2-core VMs here (400 MB: 6.9 s with it, 1.3 s without), so a SmolLM2-135M ZeRO-3
    checkpoint (1.6 GB of Adam state and fp32 master weights) spent ~11 of its 13 s on it, and a 7B model's
    would spend minutes. It guards nothing here: torch.load does not check it (a flipped byte loads as a
    different value, measured), and resume checks each file's size, and the sha256 of the small ones, against
    the manifest (`verify`). Only `unzip -t` on a checkpoint file would complain."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def latest_complete(root: str | os.PathLike) -> str | None:
    """The newest checkpoint under `root` that verifies; corrupt/partial ones are skipped with a warning."""
    for _, p in reversed(_step_dirs(Path(root))):
        problems = verify(p)
        if not problems:
            return str(p)
        msg = f"skipping checkpoint {p}: " + "; ".join(problems[:5]) + (" ..." if len(problems) > 5 else "")
        log.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
    return None


def load_driver_state(path: str | os.PathLike) -> dict:
    return json.loads((Path(path) / DRIVER_STATE).read_text())


def _list_files(d: Path) -> dict:
    files = {}
    for f in sorted(d.rglob("*")):
        if f.is_file() and f.name != MANIFEST:
            size = f.stat().st_size
            entry = {"size": size}
            if size <= HASH_LIMIT:
                entry["sha256"] = _sha256(f)
            files[f.relative_to(d).as_posix()] = entry
    return files


def _write_json_atomic(path: Path, data) -> None:
    replace_text(path, json.dumps(data, indent=1, sort_keys=True, allow_nan=True), durable=True)


def match_umask(d: str | os.PathLike) -> None:
    """Give every file under `d` the permissions the process's umask gives a new file (0644 under the
    usual 022). safetensors writes through a private temporary file (0600), so weights came out
    readable by their owner only while everything else of a run was 0644."""
    mask = os.umask(0)
    os.umask(mask)
    mode = 0o666 & ~mask
    for f in Path(d).rglob("*"):
        if f.is_file() and not f.is_symlink() and (f.stat().st_mode & 0o777) != mode:
            with contextlib.suppress(OSError):
                f.chmod(mode)


# --------------------------------------------------------------------------- #
# RNG states as JSON (no pickle)
# --------------------------------------------------------------------------- #
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state() -> dict:
    """python `random`, numpy's global and torch's (CPU + CUDA) generators as JSON-safe data."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])


# --------------------------------------------------------------------------- #
# per-rank worker state (used by LearnerWorker)
# --------------------------------------------------------------------------- #
def _worker_state_path(path, tag, rank) -> Path:
    return Path(path) / tag / f"raygrpo_rank_{rank:05d}.json"


def write_worker_state(path: str, tag: str, rank: int, state: dict) -> None:
    p = _worker_state_path(path, tag, rank)
    p.parent.mkdir(parents=True, exist_ok=True)
    _write_json_atomic(p, state)


def read_worker_state(path: str, tag: str, rank: int) -> dict:
    p = _worker_state_path(path, tag, rank)
    if not p.is_file():
        raise FileNotFoundError(f"{p} is missing: was this checkpoint written with a different number of ranks?")
    return json.loads(p.read_text())


def write_hf_meta(model_path: str, out_dir: str | os.PathLike) -> None:
    """Config, generation config and tokenizer of `model_path` (no weights) into out_dir."""
    from transformers import AutoConfig, AutoTokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    AutoConfig.from_pretrained(model_path).save_pretrained(out)
    AutoTokenizer.from_pretrained(model_path).save_pretrained(out)
    gen = Path(model_path) / "generation_config.json"
    if gen.is_file():
        shutil.copy2(gen, out / gen.name)


# --------------------------------------------------------------------------- #
# safe loading of DeepSpeed's torch.save files
# --------------------------------------------------------------------------- #
def _deepspeed_safe_globals() -> list:
    """The non-tensor types DeepSpeed 0.19.8 pickles into its checkpoint files (found by loading
    ZeRO-0/2/3 checkpoints with weights_only=True): allow-listed, instead of unpickling anything."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@contextlib.contextmanager
def safe_torch_load():
    """Make every torch.load inside the block use weights_only=True (with DeepSpeed's few plain
    types allow-listed), whatever the caller passed. DeepSpeed 0.19.8 hard-codes
    weights_only=False in its loaders (engine, ZeRO optimizers, zero_to_fp32)."""
    original = torch.load

    def load(*args, **kwargs):
        kwargs["weights_only"] = True
        with torch.serialization.safe_globals(_deepspeed_safe_globals()):
            return original(*args, **kwargs)

    torch.load = load
    try:
        yield
    finally:
        torch.load = original
