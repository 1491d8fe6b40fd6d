"""The wire protocol of the CPU `gloo` weight-transfer backend: what both sides share.

The trainer side (actors/transport/gloo_trainer.py) and the engine side (actors/transport/gloo_engine.py) import
this module; neither imports the other's.

Group layout and handshake (what `GlooTrainerWeightTransferEngine.trainer_init` does):

    trainer rank 0 (sender)                         every vLLM worker of every engine
    -----------------------                         ---------------------------------
    TCPStore on master only (port or 0 -> free port)
    payload = {master_address, master_port,  --->   init_weight_transfer_engine(payload):
               world_size, generation,                tear down a previous group (re-init works)
               rank_offset=None, bucket_bytes,        join the store, keys under `generation/`
               timeout_s, shared_memory_*}            rank = store.add("next_rank", 1)  (1, 2, ...)
                                                      answer SHARED_MEMORY_KEY (maps the segment?)
    ProcessGroupGloo(rank 0)                <--->     ProcessGroupGloo(rank)   (rendezvous)

`world_size` = 1 + the number of vLLM workers (engines x tensor_parallel_size). Ranks are
claimed from an atomic store counter, so one identical payload can be fanned out to any number
of engines by `RayVLLMWeightSyncClient`; a worker given an explicit `rank_offset` instead takes
`rank_offset + its rank inside the engine` (the NCCL convention).

One update (`send_weights`): the sender sends the parameter list (names, dtypes, shapes) with
`update_weights`, then broadcasts the tensors packed into uint8 buckets; the update info says the
bucket size (`pipeline_bucket_bytes`: about an eighth of the update, at most the init's `bucket_bytes`)
and both sides cut the buckets with the same rule (`plan_buckets`), so no sizes travel per bucket.
The engine posts the receive of bucket k+1 before it loads bucket k (`model.load_weights`, or direct
copies) and re-packs vLLM's CPU linear layers whose weights that bucket completed; its
`finish_weight_update` re-packs the rest (actors/transport/vllm_plugin.py).

Same machine: when every engine could map the sender's shared-memory segment at init
(actors/transport/shared_memory.py), the sender packs each bucket straight into it and the broadcast
carries only a `header` (bucket index, bytes); a barrier between buckets tells the sender the
engines are done reading. The update info says which transport an update uses.

A sender that gives up on an update (an engine failed, or its host was lost) sets GAVE_UP_KEY in the
store before it drops its group: ProcessGroupGloo.abort() closes no socket, so an engine waiting on a
bucket would otherwise wait out the gloo timeout, its actor answering nothing meanwhile. The engines
look at that key (or find the store gone) every SENDER_CHECK_EVERY_S while they wait. Neither side
drops a group with an op in flight on its own thread: ProcessGroupGloo's destructor waits for that op,
up to the gloo timeout (`TrackedGroup.release`).
"""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import (  # noqa: TID253 (vLLM side)
    ParamMeta,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
DEFAULT_TIMEOUT_S = 600.0
RANK_COUNTER = "next_rank"
PEER_ERROR_GRACE_S = 5.0  # how long a failed broadcast waits for the peer's own error
SHARED_MEMORY_KEY = "shared_memory/{rank}"  # each engine's answer: "ok" or why it cannot map the segment
GAVE_UP_KEY = "sender_gave_up"  # set by a sender that abandoned an update: the engines stop waiting
SENDER_CHECK_EVERY_S = 0.1  # how often a waiting engine looks at GAVE_UP_KEY (one store round trip)
# Over the wire an update goes in at least this many buckets (each at least MIN_PIPELINE_BUCKET_BYTES,
# at most bucket_bytes), so that each side works on one bucket while the next travels: the sender packs
# bucket k+1 while k is broadcast, the engine loads (and re-packs the CPU layers of) bucket k while k+1
# arrives. In one 64 MiB bucket a 50.85 MiB update did all three one after another (docs/STATUS.md,
# "Multi-node": 0.213 s against 0.055 s for the raw broadcast of its bytes).
PIPELINE_BUCKETS = 8
MIN_PIPELINE_BUCKET_BYTES = 1 << 20


# --------------------------------------------------------------------------- #
# Wire helpers
# --------------------------------------------------------------------------- #
def plan_buckets(sizes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Indices of the tensors in each packed bucket: fill a bucket until it holds more than
    `bucket_bytes` (the rule of vLLM's `pack_tensors`), so a tensor larger than a bucket
    travels alone. Both sides call this on the same sizes, so they cut the stream alike."""
    buckets, current, total = [], [], 0
    for i, size in enumerate(sizes):
        current.append(i)
        total += size
        if total > bucket_bytes:
            buckets.append(current)
            current, total = [], 0
    if current:
        buckets.append(current)
    return buckets


def pipeline_bucket_bytes(total_bytes: int, bucket_bytes: int) -> int:
    """The bucket size of a broadcast update of `total_bytes`: about 1/PIPELINE_BUCKETS of it, within
    [MIN_PIPELINE_BUCKET_BYTES, bucket_bytes]. The sender picks it and sends it in the update info."""
    return max(1, min(bucket_bytes, max(MIN_PIPELINE_BUCKET_BYTES, math.ceil(total_bytes / PIPELINE_BUCKETS))))


def nbytes(shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def max_bucket_bytes(sizes: list[int], buckets: list[list[int]]) -> int:
    """The bytes of the largest of `buckets` (plan_buckets' index lists over `sizes`)."""
    return max((sum(sizes[i] for i in b) for b in buckets), default=0)


def header(index: int, size: int) -> torch.Tensor:
    """What the shared-memory transport broadcasts per bucket: which bucket is ready, and its bytes."""
    return torch.tensor([index, size], dtype=torch.int64)


def unpack_bucket(buffer: torch.Tensor, names: list[str], shapes: list[list[int]],
                  dtypes: list[torch.dtype], sizes: list[int]) -> list[tuple[str, torch.Tensor]]:
    """Split a received uint8 bucket back into named tensors: views where the byte offset suits
    the dtype, copies where it does not (a float32 after an odd-length bf16 tensor cannot be a
    view; vLLM's own `unpack_tensor` fails there)."""
    out, offset = [], 0
    for name, shape, dtype, size in zip(names, shapes, dtypes, sizes):
        raw = buffer[offset:offset + size]
        if offset % dtype.itemsize:
            raw = raw.clone()
        out.append((name, raw.view(dtype).view(shape)))
        offset += size
    return out


class BucketBuffers:
    """uint8 buffers for packed buckets, kept from one update to the next and used in rotation.

    A new buffer per bucket and update costs its page faults every time: packing the 1.0M bench
    model (3.8 MiB) took 1.25 ms into a fresh buffer and 0.34 ms into a kept one. With `count`
    buffers, the one handed out was last handed out `count` calls ago: the sender uses 2 (it packs
    bucket k+1 while bucket k is on the wire, and waits for k before it packs k+2)."""

    def __init__(self, count: int):
        self._buffers: list[torch.Tensor | None] = [None] * count
        self._next = 0

    def take(self, size: int) -> torch.Tensor:
        i, self._next = self._next, (self._next + 1) % len(self._buffers)
        if self._buffers[i] is None or self._buffers[i].numel() < size:
            self._buffers[i] = torch.empty(size, dtype=torch.uint8)
        return self._buffers[i][:size]


class TrackedGroup:
    """A ProcessGroupGloo that remembers its ops in flight, so that dropping it never blocks.

    Dropping the last reference to a ProcessGroupGloo waits for every op it has in flight, and an op
    with a silent peer (a host that vanished, an engine that stopped reading) ends only at the gloo
    timeout: a learner or engine that gave up on an update sat there for trainer.actor_timeout_s,
    answering nothing. `release()` hands such a group to a daemon thread that keeps it until its ops
    have ended (failed, at the latest at the timeout), then lets it go."""

    def __init__(self, group):
        self.group = group
        self.works: list = []

    def broadcast(self, tensor, root: int):
        return self._track(self.group.broadcast(tensor, root))

    def barrier(self):
        return self._track(self.group.barrier())

    def _track(self, work):
        self.works = [w for w in self.works if not w.is_completed()] + [work]
        return work

    def release(self) -> None:
        """Let the group go now, or, with ops still in flight, once they have ended (never blocks)."""
        pending = [w for w in self.works if not w.is_completed()]
        if pending:
            threading.Thread(target=_keep_until_done, args=(self.group, pending), daemon=True,
                             name="gloo-group-release").start()
        self.group, self.works = None, []


def _keep_until_done(group, works: list) -> None:
    while not all(w.is_completed() for w in works):
        time.sleep(1.0)
    del group  # the last reference, with nothing in flight: the destructor returns at once


def wait_work(work, timeout_s: float, peer_failed: Callable[[], None] | None = None,
              check_every_s: float = 1e-3) -> None:
    """Wait for an async gloo op, but surface a failed peer at once instead of sitting out the gloo
    timeout (`peer_failed`, called every `check_every_s`, raises the peer's error when it has one).
    Without `peer_failed` it blocks in gloo (without the GIL; the group's own timeout bounds it)."""
    deadline = time.monotonic() + timeout_s
    next_check = time.monotonic() + check_every_s
    # Poll finely at first: a header or barrier completes in ~0.1 ms and a small model's bucket in
    # a few; doubling from 50 us woke up to ~0.4 ms late. Ask the peer every check_every_s (a Ray
    # wait costs ~0.1 ms, a store round trip about as much).
    pause = 2e-5
    while peer_failed is not None and not work.is_completed():
        now = time.monotonic()
        if now >= next_check:
            peer_failed()
            next_check = now + check_every_s
        if now > deadline:
            raise TimeoutError(f"gloo weight broadcast did not complete in {timeout_s:.0f}s")
        time.sleep(pause)
        pause = min(1.25 * pause, 1e-3)
    try:
        work.wait()  # re-raises a gloo error
    except Exception:
        # A peer whose side failed closes the group (actors/transport/gloo_engine.py); its RPC's error
        # says why, and arrives a moment later: prefer it to gloo's "connection closed".
        deadline = time.monotonic() + PEER_ERROR_GRACE_S
        while peer_failed is not None and time.monotonic() < deadline:
            peer_failed()
            time.sleep(0.01)
        raise


# --------------------------------------------------------------------------- #
# Init / update info
# --------------------------------------------------------------------------- #
@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """Engine-side init info (the payload the trainer fans out to every engine)."""

    master_address: str
    master_port: int
    world_size: int
    master_hostname: str = ""  # the sender's host, named when an engine cannot reach master_address
    generation: str = ""  # store key prefix, fresh per trainer_init, so stale keys never collide
    rank_offset: int | None = None  # None: claim a rank from the store counter
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    shared_memory_path: str = ""  # the sender's segment ("" = none); the engine answers whether it maps it
    shared_memory_bytes: int = 0
    shared_memory_nonce: str = ""


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """Per-update info: the parameters, in broadcast order (the buckets follow from it)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    shared_memory: bool = False  # the buckets come through the shared segment, the broadcast carries headers
    bucket_bytes: int = 0  # how this update's buckets are cut (plan_buckets); 0: the init's bucket_bytes

    def __post_init__(self):
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names/dtype_names/shapes differ in length: "
                f"{len(self.names)}/{len(self.dtype_names)}/{len(self.shapes)}"
            )

    @classmethod
    def from_metadata(cls, meta: list[ParamMeta]) -> GlooWeightTransferUpdateInfo:
        return cls(
            names=[m.name for m in meta],
            dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
            shapes=[list(m.shape) for m in meta],
        )

    def dtypes(self) -> list[torch.dtype]:
        return [getattr(torch, d) for d in self.dtype_names]
