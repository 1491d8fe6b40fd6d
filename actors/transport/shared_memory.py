"""A shared-memory segment for weight updates between processes of one machine.

Over loopback, a gloo broadcast copies every byte through the kernel's socket buffers: 3.8 MiB
took 1.2-1.7 ms on the 2-core bench machines, and the sender's pack and the engine's copy come
on top (docs/benchmarks.md, "Weight sync"). When the engines run on the learner's machine, the
sender can pack each bucket straight into memory that the engines map too; gloo then carries
only a 16-byte header per bucket. Engines on other machines cannot map the segment; the sender
then uses the gloo broadcast for everyone (actors/transport/gloo_trainer.py decides; actors/transport/gloo_protocol.py has the wire format).

The segment is a file in /dev/shm (tmpfs) mapped with MAP_SHARED by `torch.from_file`. The
sender unlinks it as soon as every engine answered, so nothing is left behind whatever happens
to the processes later; the mappings stay valid until each side drops its tensor. A random
nonce at the start of the file proves that an engine mapped the sender's segment and not a
namesake on another machine.
"""
from __future__ import annotations

import os
import secrets
import uuid

import torch

SHM_DIR = "/dev/shm"
NONCE_BYTES = 16
# Leave this share of /dev/shm free: Ray's object store lives there too, and Docker's default
# /dev/shm is only 64 MiB.
MAX_SHARE_OF_FREE = 0.5


def create_segment(nbytes: int) -> tuple[str, str, torch.Tensor] | None:
    """A new segment of `nbytes` (>= NONCE_BYTES) mapped here: (path, nonce hex, uint8 tensor),
    or None where /dev/shm is missing or has too little room (the caller uses the network)."""
    nbytes = max(nbytes, NONCE_BYTES)
    try:
        free = os.statvfs(SHM_DIR)
    except OSError:
        return None
    if nbytes > MAX_SHARE_OF_FREE * free.f_bavail * free.f_frsize:
        return None
    path = os.path.join(SHM_DIR, f"raygrpo-weights-{uuid.uuid4().hex}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:  # not writable here (a read-only or foreign /dev/shm)
        return None
    try:
        os.ftruncate(fd, nbytes)
        tensor = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    except (OSError, RuntimeError):
        unlink(path)
        return None
    finally:
        os.close(fd)
    nonce = secrets.token_bytes(NONCE_BYTES)
    tensor[:NONCE_BYTES] = torch.frombuffer(bytearray(nonce), dtype=torch.uint8)
    return path, nonce.hex(), tensor


def attach_segment(path: str, nbytes: int, nonce: str) -> tuple[torch.Tensor | None, str]:
    """Map the sender's segment: (tensor, "") when it is there and carries `nonce`, else
    (None, why not)."""
    try:
        if os.path.getsize(path) != max(nbytes, NONCE_BYTES):
            return None, f"{path} has another size"
        tensor = torch.from_file(path, shared=True, size=max(nbytes, NONCE_BYTES), dtype=torch.uint8)
    except (OSError, RuntimeError) as e:
        return None, f"cannot map {path}: {e}"
    if bytes(tensor[:NONCE_BYTES].tolist()).hex() != nonce:
        return None, f"{path} is not the sender's segment (another machine)"
    return tensor, ""


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
