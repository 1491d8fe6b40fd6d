"""A CPU `gloo` backend for vLLM's RL weight-transfer API: the protocol and the trainer side.

vLLM 0.32 moves weights from a trainer into running engines through a pluggable
`WeightTransferEngine` (inside each vLLM worker) and a `TrainerWeightTransferEngine` (inside
the trainer), but its built-in backends (nccl, ipc, ...) all need CUDA. This module is the CPU
twin of `vllm/distributed/weight_transfer/nccl_engine.py`: the same handshake and the same
packed buckets, over a `torch.distributed.ProcessGroupGloo` built on its own `TCPStore`.

The group is private: it never touches the default (global) process group, so a trainer that
already runs DeepSpeed/torch.distributed keeps its own world untouched.

Group layout and handshake (what `GlooTrainerWeightTransferEngine.trainer_init` does):

    trainer rank 0 (sender)                         every vLLM worker of every engine
    -----------------------                         ---------------------------------
    TCPStore on master only (port or 0 -> free port)
    payload = {master_address, master_port,  --->   init_weight_transfer_engine(payload):
               world_size, generation,                tear down a previous group (re-init works)
               rank_offset=None, bucket_bytes,        join the store, keys under `generation/`
               timeout_s}                             rank = store.add("next_rank", 1)  (1, 2, ...)
    ProcessGroupGloo(rank 0)                <--->     ProcessGroupGloo(rank)   (rendezvous)

`world_size` = 1 + the number of vLLM workers (engines x tensor_parallel_size). Ranks are
claimed from an atomic store counter, so one identical payload can be fanned out to any number
of engines by `RayVLLMWeightSyncClient`; a worker given an explicit `rank_offset` instead takes
`rank_offset + its rank inside the engine` (the NCCL convention).

One update (`send_weights`): the sender sends the parameter list (names, dtypes, shapes) with
`update_weights`, then broadcasts the tensors packed into uint8 buckets of about `bucket_bytes`;
both sides cut the buckets with the same rule (`plan_buckets`), so no sizes travel per bucket.
The engine side (`GlooWeightTransferEngine`, actors/gloo_engine.py) loads each bucket with
`model.load_weights`; its `finish_weight_update` re-packs vLLM's CPU linear layers
(actors/vllm_ext.py).

Same machine: when every engine could map the sender's shared-memory segment at init
(actors/shared_memory.py), the sender packs each bucket straight into it and the broadcast
carries only a header (bucket index, bytes); a barrier between buckets tells the sender the
engines are done reading. The update info says which transport an update uses.

Importing this module registers the trainer engine with vLLM's `WeightTransferTrainerFactory`,
so the learner (which does not load vLLM plugins) can call `WeightTransferTrainerFactory.trainer_init(
GlooTrainerInitInfo(...), client=..., source=...)` after `import actors.gloo_transfer`.
"""
from __future__ import annotations

import datetime
import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from actors import shared_memory
from actors.sockets import listening_store, local_ip_towards

BACKEND = "gloo"
# The engine-side class, named (not imported: it imports this module) for vLLM to load lazily in its
# workers; tests/unit/test_entry_points.py checks the name resolves.
ENGINE_MODULE, ENGINE_CLASS = "actors.gloo_engine", "GlooWeightTransferEngine"
DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
DEFAULT_TIMEOUT_S = 600.0
RANK_COUNTER = "next_rank"
PEER_ERROR_GRACE_S = 5.0  # how long a failed broadcast waits for the peer's own error
SHARED_MEMORY_KEY = "shared_memory/{rank}"  # each engine's answer: "ok" or why it cannot map the segment


# --------------------------------------------------------------------------- #
# Wire helpers shared by both sides
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


def nbytes(shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def max_bucket_bytes(sizes: list[int], bucket_bytes: int) -> int:
    return max((sum(sizes[i] for i in b) for b in plan_buckets(sizes, bucket_bytes)), default=0)


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


def default_master_address() -> str:
    """The address a trainer should advertise: Ray's node IP inside Ray, else loopback."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - Ray is optional here
        pass
    return "127.0.0.1"


def new_gloo_group(store, rank: int, world_size: int, master_address: str, timeout_s: float):
    """A ProcessGroupGloo over `store` (blocks until all `world_size` ranks joined)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        opts._devices = [dist.ProcessGroupGloo.create_device(interface=os.environ["GLOO_SOCKET_IFNAME"])]
    else:
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_ip_towards(master_address))]
    return dist.ProcessGroupGloo(store, rank, world_size, opts)


def wait_work(work, timeout_s: float, peer_failed: Callable[[], None] | None = None) -> None:
    """Wait for an async gloo op, but surface a failed peer RPC at once instead of sitting out
    the gloo timeout (`peer_failed` raises the RPC's error when it has one). Without
    `peer_failed` it blocks in gloo (without the GIL; the group's own timeout bounds it)."""
    deadline = time.monotonic() + timeout_s
    next_check = time.monotonic() + 1e-3
    # Poll finely at first: a header or barrier completes in ~0.1 ms and a small model's bucket in
    # a few; doubling from 50 us woke up to ~0.4 ms late. Ask the peer at most every ms (a Ray
    # wait costs ~0.1 ms).
    pause = 2e-5
    while peer_failed is not None and not work.is_completed():
        now = time.monotonic()
        if now >= next_check:
            peer_failed()
            next_check = now + 1e-3
        if now > deadline:
            raise TimeoutError(f"gloo weight broadcast did not complete in {timeout_s:.0f}s")
        time.sleep(pause)
        pause = min(1.25 * pause, 1e-3)
    try:
        work.wait()  # re-raises a gloo error
    except Exception:
        # A peer whose side failed closes the group (actors/gloo_engine.py); its RPC's error
        # says why, and arrives a moment later: prefer it to gloo's "connection closed".
        deadline = time.monotonic() + PEER_ERROR_GRACE_S
        while peer_failed is not None and time.monotonic() < deadline:
            peer_failed()
            time.sleep(0.01)
        raise


class _Background:
    """Run a blocking call on a daemon thread (a hung peer must never block interpreter exit,
    which a ThreadPoolExecutor worker would)."""

    def __init__(self, fn: Callable, *args):
        self.error: BaseException | None = None
        self.result = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), daemon=True)
        self._thread.start()

    def _run(self, fn, args):
        try:
            self.result = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            self.error = e

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def raise_if_failed(self) -> None:
        if self.done and self.error is not None:
            raise self.error

    def join(self, timeout_s: float):
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"weight-transfer RPC did not return in {timeout_s:.0f}s")
        self.raise_if_failed()
        return self.result


# --------------------------------------------------------------------------- #
# Init / update info
# --------------------------------------------------------------------------- #
@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """Engine-side init info (the payload the trainer fans out to every engine)."""

    master_address: str
    master_port: int
    world_size: int
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


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info. `rank` (keyword) is this trainer process's rank; rank 0 sends.

    world_size: 1 + the number of vLLM workers across all engines (engines x TP size).
    master_address: an address of the sender's machine that the engines can reach
        (`default_master_address()` gives Ray's node IP). master_port 0 picks a free port.
    """

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    shared_memory: bool = True  # offer the engines a shared-memory segment (used when all of them map it)


# --------------------------------------------------------------------------- #
# Trainer side
# --------------------------------------------------------------------------- #
class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer-side gloo engine. Call `trainer_init` and `send_weights` on every trainer rank:
    rank 0 hosts the store, drives the engines through `client` and broadcasts; the other ranks
    only iterate `source` (its per-layer gathers are collectives among the trainer ranks)."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource, is_sender: bool = True,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.store = None
        self.group = None
        self.last_parts: dict[str, float] = {}  # seconds of the last send's parts (the bench reports them)
        self._buffers = BucketBuffers(2)
        self.segment: torch.Tensor | None = None  # the shared-memory segment every engine mapped
        self.refused: list[str] = []  # why engines could not map it (then every update goes by gloo)

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> GlooTrainerWeightTransferEngine:
        if source is None:
            raise ValueError("gloo trainer weight transfer needs a WeightSource")
        if init_info.world_size < 2:
            raise ValueError(f"world_size must be >= 2 (the sender + >= 1 vLLM worker), got {init_info.world_size}")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender,
                     bucket_bytes=init_info.bucket_bytes, timeout_s=init_info.timeout_s)
        if not engine.is_sender:
            return engine

        timeout = datetime.timedelta(seconds=init_info.timeout_s)
        store = listening_store(init_info.master_address, init_info.master_port, timeout)
        generation = uuid.uuid4().hex
        segment = None
        if init_info.shared_memory:
            sizes = [nbytes(m.shape, m.dtype) for m in source.metadata()]
            segment = shared_memory.create_segment(max_bucket_bytes(sizes, init_info.bucket_bytes))
        offer = {"shared_memory_path": segment[0], "shared_memory_bytes": segment[2].numel(),
                 "shared_memory_nonce": segment[1]} if segment else {}
        payload = asdict(GlooWeightTransferInitInfo(
            master_address=init_info.master_address, master_port=store.port,
            world_size=init_info.world_size, generation=generation,
            bucket_bytes=init_info.bucket_bytes, timeout_s=init_info.timeout_s, **offer,
        ))
        prefixed = dist.PrefixStore(f"raygrpo/{generation}/", store)
        try:
            engine.group = _join_engines(client, payload, prefixed, init_info)
            if segment is not None:
                # Every engine answered before it joined the group; the file can go now (the
                # mappings stay), so no exit, crash or kill leaves it behind.
                answers = [prefixed.get(SHARED_MEMORY_KEY.format(rank=r)).decode()
                           for r in range(1, init_info.world_size)]
                engine.segment = segment[2] if all(a == "ok" for a in answers) else None
                engine.refused = sorted({a for a in answers if a != "ok"})
        finally:
            if segment is not None:
                shared_memory.unlink(segment[0])
        engine.store = store
        return engine

    def send_weights(self, weight_version: int | str | None = None) -> None:
        """One full update of every engine; `weight_version` (optional) is set on the engines
        by `finish_weight_update` (an extension of the base signature)."""
        source = self.source
        assert source is not None
        meta = source.metadata()
        if not self.is_sender:
            for _ in source:  # stay in the trainer-side gathers
                pass
            return
        if self.group is None:
            raise RuntimeError("send_weights after shutdown(); call trainer_init again")

        info = GlooWeightTransferUpdateInfo.from_metadata(meta)
        sizes = [nbytes(m.shape, m.dtype) for m in meta]
        info.shared_memory = self.segment is not None and max_bucket_bytes(sizes, self.bucket_bytes) <= self.segment.numel()
        t0 = time.perf_counter()
        self.client.start_weight_update()
        # The engines' update_weights blocks until the last bucket arrived: run it beside the
        # broadcast, and fail fast if it errors (instead of sitting out the gloo timeout). A
        # client that can issue it without blocking (learner/weight_sync.py OneTripRayClient)
        # does so on this thread: issued from a second thread, the Ray submission held the GIL
        # while this one packed (1.0M bench model: packing 0.65 ms alone, 2.9 ms beside it).
        submit = getattr(self.client, "submit_update_weights", None)
        rpc = submit(asdict(info)) if submit is not None else _Background(self.client.update_weights, asdict(info))
        t1 = time.perf_counter()
        try:
            pack_s = self._send(source, meta, sizes, info.shared_memory, rpc.raise_if_failed)
        except BaseException:
            # The engines wait for buckets that will never come; closing the group makes their
            # receive fail now rather than at the timeout. The caller must trainer_init again.
            self.shutdown()
            raise
        t2 = time.perf_counter()
        rpc.join(self.timeout_s)
        t3 = time.perf_counter()
        if weight_version is None:
            self.client.finish_weight_update()
        else:
            self.client.finish_weight_update(str(weight_version))
        self.last_parts = {"start_s": t1 - t0, "gather_pack_s": pack_s, "gather_pack_broadcast_s": t2 - t1,
                           "wait_engines_s": t3 - t2, "finish_call_s": time.perf_counter() - t3}

    def transport(self) -> str:
        return "shared_memory" if self.segment is not None else "gloo"

    def _send(self, source: WeightSource, meta: list[ParamMeta], sizes: list[int], shared: bool,
              peer_failed: Callable[[], None]) -> float:
        """Pack the source's tensors into the planned buckets and send them: broadcast each bucket,
        or (`shared`) pack it into the shared segment and broadcast its header. Packing the next
        bucket overlaps the previous bucket's broadcast (gloo works on its own thread).
        Returns the seconds spent gathering and packing."""
        pairs = _checked(iter(source), meta)
        buckets = plan_buckets(sizes, self.bucket_bytes)
        in_flight = None  # (work, buffer): the buffer must live until its send completes
        pack = 0.0
        for index, bucket in enumerate(buckets):
            size = sum(sizes[i] for i in bucket)
            if shared and index > 0:  # the engines are done reading the previous bucket
                wait_work(self.group.barrier(), self.timeout_s, peer_failed)
            t = time.perf_counter()
            # .cpu(): gloo sends host memory; a GPU trainer may feed CPU engines this way too.
            parts = [next(pairs)[1].detach().cpu().contiguous().view(-1).view(torch.uint8) for _ in bucket]
            buffer = torch.cat(parts, out=self.segment[:size] if shared else self._buffers.take(size))
            pack += time.perf_counter() - t
            if in_flight is not None:
                wait_work(in_flight[0], self.timeout_s, peer_failed)
            message = header(index, size) if shared else buffer
            in_flight = (self.group.broadcast(message, 0), message)
        if in_flight is not None:
            wait_work(in_flight[0], self.timeout_s, peer_failed)
        for name, _ in pairs:  # exhausts the source; raises if it yields more than declared
            raise ValueError(f"WeightSource yielded more parameters than metadata() declared; first extra {name!r}")
        return pack

    def shutdown(self) -> None:
        if self.group is not None:
            try:
                self.group.abort()  # abort, not shutdown: never wait on engines that may be gone
            except Exception:  # noqa: BLE001
                pass
        self.group, self.store, self.segment = None, None, None


def _join_engines(client: VLLMWeightSyncClient, payload: dict, prefixed, init_info: GlooTrainerInitInfo):
    """Send the engines their init payload and form the group with them (rank 0 here)."""
    # The engines block in init until the group forms, and so do we: run the RPC beside it.
    rpc = _Background(client.init_weight_transfer_engine, payload)
    join = _Background(new_gloo_group, prefixed, 0, init_info.world_size, init_info.master_address,
                       init_info.timeout_s)
    deadline = time.monotonic() + init_info.timeout_s
    while not join.done:
        rpc.raise_if_failed()  # an engine refused the init: fail now, not after the timeout
        if time.monotonic() > deadline:
            joined = prefixed.add(RANK_COUNTER, 0)
            raise TimeoutError(
                f"gloo weight transfer: {joined} of {init_info.world_size - 1} vLLM workers joined "
                f"in {init_info.timeout_s:.0f}s; is world_size 1 + engines x tensor_parallel_size?"
            )
        time.sleep(0.01)
    group = join.join(0)
    rpc.join(init_info.timeout_s)
    return group


def _checked(pairs: Iterator[tuple[str, torch.Tensor]], meta: list[ParamMeta]):
    """The source's pairs, each checked against the metadata the engines were sent: a mismatch
    would make the two sides cut buckets differently and load garbage."""
    for i, expected in enumerate(meta):
        try:
            name, tensor = next(pairs)
        except StopIteration:
            raise ValueError(f"WeightSource yielded {i} parameters but metadata() declared {len(meta)}") from None
        if name != expected.name or tensor.dtype != expected.dtype or tuple(tensor.shape) != tuple(expected.shape):
            raise ValueError(
                f"WeightSource iteration disagrees with metadata() at index {i}: declared {expected.name!r} "
                f"{expected.dtype} {tuple(expected.shape)}, got {name!r} {tensor.dtype} {tuple(tensor.shape)}"
            )
        yield name, tensor
    yield from pairs


# --------------------------------------------------------------------------- #
# Registration with vLLM's factories (idempotent)
# --------------------------------------------------------------------------- #
def register_engine_backend() -> None:
    """Make `weight_transfer_config={"backend": "gloo"}` resolve inside vLLM workers."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        # Lazily, like vLLM's own backends: the trainer never needs the engine-side class.
        WeightTransferEngineFactory.register_engine(BACKEND, ENGINE_MODULE, ENGINE_CLASS)


def register_trainer_backends() -> None:
    """Make `WeightTransferTrainerFactory.trainer_init(GlooTrainerInitInfo(...))` work in the
    trainer (which does not load vLLM's general plugins)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, GlooTrainerWeightTransferEngine)


register_trainer_backends()
