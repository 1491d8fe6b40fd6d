"""A CPU `gloo` backend for vLLM's RL weight-transfer API: the trainer side.

vLLM 0.32 moves weights from a trainer into running engines through a pluggable
`WeightTransferEngine` (inside each vLLM worker) and a `TrainerWeightTransferEngine` (inside
the trainer), but its built-in backends (nccl, ipc, ...) all need CUDA. This backend is the CPU
twin of `vllm/distributed/weight_transfer/nccl_engine.py`: the same handshake and the same
packed buckets, over a `torch.distributed.ProcessGroupGloo` built on its own `TCPStore`.
The protocol both sides share (handshake, buckets, the shared-memory transport) is in
actors/transport/gloo_protocol.py; the engine side is actors/transport/gloo_engine.py.

The group is private: it never touches the default (global) process group, so a trainer that
already runs DeepSpeed/torch.distributed keeps its own world untouched.

Importing this module registers the trainer engine with vLLM's `WeightTransferTrainerFactory`,
so the learner (which does not load vLLM plugins) can call `WeightTransferTrainerFactory.trainer_init(
GlooTrainerInitInfo(...), client=..., source=...)` after `import actors.transport.gloo_trainer`.
"""
from __future__ import annotations

import datetime
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (  # noqa: TID253 (vLLM side)
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from actors.runtime.background import Background
from actors.runtime.process_groups import listening_store, new_gloo_group
from actors.transport import shared_memory
from actors.transport.gloo_protocol import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_TIMEOUT_S,
    GAVE_UP_KEY,
    RANK_COUNTER,
    SHARED_MEMORY_KEY,
    BucketBuffers,
    GlooWeightTransferInitInfo,
    GlooWeightTransferUpdateInfo,
    TrackedGroup,
    header,
    max_bucket_bytes,
    nbytes,
    pipeline_bucket_bytes,
    plan_buckets,
    wait_work,
)

BACKEND = "gloo"
# The engine-side class, named (not imported) for vLLM to load lazily in its
# workers; tests/unit/test_entry_points.py checks the name resolves.
ENGINE_MODULE, ENGINE_CLASS = "actors.transport.gloo_engine", "GlooWeightTransferEngine"


def default_master_address() -> str:
    """The address a trainer should advertise: Ray's node IP inside Ray, else loopback."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - Ray is optional here
        pass
    return "127.0.0.1"


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
        self.prefixed = None  # the store under this init's generation: where GAVE_UP_KEY is set
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
            segment = shared_memory.create_segment(max_bucket_bytes(sizes, plan_buckets(sizes, init_info.bucket_bytes)))
        offer = {"shared_memory_path": segment[0], "shared_memory_bytes": segment[2].numel(),
                 "shared_memory_nonce": segment[1]} if segment else {}
        payload = asdict(GlooWeightTransferInitInfo(
            master_address=init_info.master_address, master_port=store.port,
            world_size=init_info.world_size, master_hostname=socket.gethostname(), generation=generation,
            bucket_bytes=init_info.bucket_bytes, timeout_s=init_info.timeout_s, **offer,
        ))
        prefixed = dist.PrefixStore(f"raygrpo/{generation}/", store)
        try:
            engine.group = TrackedGroup(_join_engines(client, payload, prefixed, init_info))
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
        engine.store, engine.prefixed = store, prefixed
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
        info.shared_memory = (self.segment is not None
                              and max_bucket_bytes(sizes, plan_buckets(sizes, self.bucket_bytes)) <= self.segment.numel())
        # By broadcast, smaller buckets: each side works on one while the next travels (gloo_protocol.py).
        info.bucket_bytes = (self.bucket_bytes if info.shared_memory
                             else pipeline_bucket_bytes(sum(sizes), self.bucket_bytes))
        buckets = plan_buckets(sizes, info.bucket_bytes)
        t0 = time.perf_counter()
        self.client.start_weight_update()
        # The engines' update_weights blocks until the last bucket arrived: run it beside the
        # broadcast, and fail fast if it errors (instead of sitting out the gloo timeout). A
        # client that can issue it without blocking (learner/weight_sync.py OneTripRayClient)
        # does so on this thread: issued from a second thread, the Ray submission held the GIL
        # while this one packed (1.0M bench model: packing 0.65 ms alone, 2.9 ms beside it).
        submit = getattr(self.client, "submit_update_weights", None)
        rpc = submit(asdict(info)) if submit is not None else Background(self.client.update_weights, asdict(info))
        t1 = time.perf_counter()
        try:
            pack_s = self._send(source, meta, sizes, buckets, info.shared_memory, rpc.raise_if_failed)
        except BaseException:
            # The engines wait for buckets that will never come; shutdown() tells them, so their
            # receive fails now rather than at the timeout. The caller must trainer_init again.
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

    def _send(self, source: WeightSource, meta: list[ParamMeta], sizes: list[int], buckets: list[list[int]],
              shared: bool, peer_failed: Callable[[], None]) -> float:
        """Pack the source's tensors into the planned `buckets` and send them: broadcast each bucket,
        or (`shared`) pack it into the shared segment and broadcast its header. Packing the next
        bucket overlaps the previous bucket's broadcast (gloo works on its own thread).
        Returns the seconds spent gathering and packing."""
        pairs = _checked(iter(source), meta)
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
        """Drop the group without waiting on engines that may be gone (TrackedGroup.release). Closing it
        reaches no engine (ProcessGroupGloo.abort() closes no socket), so an engine waiting on a bucket
        learns that the sender gave up from the store (GAVE_UP_KEY), or from the store going away."""
        if self.prefixed is not None:
            try:
                self.prefixed.set(GAVE_UP_KEY, "1")
            except Exception:  # noqa: BLE001 - the engines then find the store gone
                pass
        if self.group is not None:
            self.group.release()
        self.group, self.store, self.prefixed, self.segment = None, None, None, None


def _join_engines(client: VLLMWeightSyncClient, payload: dict, prefixed, init_info: GlooTrainerInitInfo):
    """Send the engines their init payload and form the group with them (rank 0 here)."""
    # The engines block in init until the group forms, and so do we: run the RPC beside it.
    rpc = Background(client.init_weight_transfer_engine, payload)
    join = Background(new_gloo_group, prefixed, 0, init_info.world_size, init_info.master_address,
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
