"""The engine side of the `gloo` weight-transfer backend: runs inside each vLLM worker.

vLLM creates it (`WeightTransferEngineFactory`, backend "gloo", registered by actors/transport/vllm_plugin.py)
next to the loaded model, and calls it from the worker's RL API: `init_transfer_engine` joins
the trainer's group, `update_weights` receives the packed buckets into the model (bucket k is loaded,
and the CPU linear layers it completed re-packed, while bucket k+1 arrives), and
`finish_weight_update` re-packs the rest of vLLM's CPU linear layers. The protocol is in
actors/transport/gloo_protocol.py, the trainer side in actors/transport/gloo_trainer.py; on the sender's machine the
buckets come through a shared-memory segment instead of the broadcast (actors/transport/shared_memory.py).
"""
from __future__ import annotations

import contextlib
import datetime
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import WeightTransferEngine  # noqa: TID253 (vLLM side)

from actors.runtime.process_groups import new_gloo_group
from actors.runtime.sockets import reach
from actors.transport import shared_memory
from actors.transport.base import LAST_UPDATE_PARTS
from actors.transport.direct_load import DirectLoader, signature_of
from actors.transport.gloo_protocol import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_TIMEOUT_S,
    GAVE_UP_KEY,
    RANK_COUNTER,
    SENDER_CHECK_EVERY_S,
    SHARED_MEMORY_KEY,
    BucketBuffers,
    GlooWeightTransferInitInfo,
    GlooWeightTransferUpdateInfo,
    TrackedGroup,
    header,
    nbytes,
    plan_buckets,
    unpack_bucket,
    wait_work,
)
from actors.transport.vllm_plugin import packed_layers_by_weight, repack_cpu_weights, repack_layer

if TYPE_CHECKING:
    from vllm.config import VllmConfig  # noqa: TID253 (vLLM side)
    from vllm.config.weight_transfer import WeightTransferConfig  # noqa: TID253 (vLLM side)


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """Receives packed buckets by gloo broadcast and loads them with `model.load_weights`, or by
    direct copies once the first update showed that to be the same (actors/transport/direct_load.py)."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: WeightTransferConfig, vllm_config: VllmConfig, device: torch.device,
                 model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.store = None
        self.prefixed = None  # the store under the init's generation (the sender's GAVE_UP_KEY)
        self.rank: int | None = None
        self.bucket_bytes = DEFAULT_BUCKET_BYTES
        self.timeout_s = DEFAULT_TIMEOUT_S
        self.loader = DirectLoader(model)
        self._buffers = BucketBuffers(2)  # bucket k+1 arrives in one while bucket k is copied from the other
        self.segment: torch.Tensor | None = None  # the sender's shared-memory segment, when mapped
        self.repacked: set[int] = set()  # id() of the layers this update already re-packed (finish skips them)

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        # A trainer that restarted (or re-initialised after a rollout worker restarted) opens a
        # new group; the old one would hold sockets to a peer that is gone.
        self.shutdown()
        self.bucket_bytes = init_info.bucket_bytes
        self.timeout_s = init_info.timeout_s
        timeout = datetime.timedelta(seconds=init_info.timeout_s)
        # Fail naming both hosts and the address when the sender's host does not answer, instead of the
        # store retrying it for the whole timeout and saying only that it timed out.
        reach(init_info.master_address, init_info.master_port, init_info.timeout_s, "a rollout engine's vLLM worker",
              f"the weight sender (learner rank 0){f' on {init_info.master_hostname}' if init_info.master_hostname else ''}")
        store = dist.TCPStore(init_info.master_address, init_info.master_port, is_master=False, timeout=timeout)
        prefixed = dist.PrefixStore(f"raygrpo/{init_info.generation}/", store)
        if init_info.rank_offset is None:
            rank = prefixed.add(RANK_COUNTER, 1)
        else:
            pc = self.parallel_config
            rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        if not 0 < rank < init_info.world_size:
            raise ValueError(
                f"gloo weight transfer: this worker got rank {rank} but world_size is "
                f"{init_info.world_size}; world_size must be 1 + the number of vLLM workers "
                "(engines x tensor_parallel_size)"
            )
        if init_info.shared_memory_path:  # answer before joining: the sender reads it once all joined
            self.segment, why_not = shared_memory.attach_segment(
                init_info.shared_memory_path, init_info.shared_memory_bytes, init_info.shared_memory_nonce)
            prefixed.set(SHARED_MEMORY_KEY.format(rank=rank), "ok" if self.segment is not None else why_not)
        self.group = TrackedGroup(new_gloo_group(prefixed, rank, init_info.world_size, init_info.master_address,
                                                 init_info.timeout_s))
        self.store, self.prefixed, self.rank = store, prefixed, rank

    def start_weight_update(self) -> None:
        # Weights load in place into the kept (un-removed) tensors; nothing to prepare.
        pass

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class also calls torch.accelerator.synchronize(); gloo is synchronous here.
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            # The sender waits on a bucket (or barrier) this side will never join: closing the
            # group fails its wait now (otherwise it, and dropping its group, would sit out the
            # gloo timeout). The trainer must init the transfer again.
            self.shutdown()
            raise

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer is not initialised: call init_weight_transfer_engine first")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        dtypes = update_info.dtypes()
        sizes = [nbytes(s, d) for s, d in zip(update_info.shapes, dtypes)]
        signature = signature_of(update_info.names, update_info.shapes, dtypes)
        direct = self.loader.begin(signature)
        shared = update_info.shared_memory
        if shared and self.segment is None:
            raise RuntimeError("the sender sends through shared memory but this engine did not map its segment; "
                               "re-initialise the weight transfer")
        buckets = plan_buckets(sizes, update_info.bucket_bytes or self.bucket_bytes)
        # Direct copies know which vLLM parameter each tensor lands in: a packed CPU layer is re-packed as
        # soon as its whole weight has arrived, while the next bucket travels, not after the last one.
        self.repacked = set()
        owners = self.loader.owners.get(signature, {}) if direct else {}
        layers = packed_layers_by_weight(self.model) if owners else {}
        left = Counter(owners[n] for n in update_info.names if owners.get(n) in layers)
        parts = {"receive_s": 0.0, "load_s": 0.0, "repack_during_s": 0.0}
        incoming = (self._shared_buckets(buckets, sizes, keep=direct, parts=parts) if shared
                    else self._broadcast_buckets(buckets, sizes, reuse=direct, parts=parts))
        # closing(): on a failure the receive already posted must not outlive this call: held by the
        # traceback, it kept the group's sockets open and the sender waited out the gloo timeout.
        with disable_mtp_completeness_check(), contextlib.closing(incoming):
            for index, buffer in incoming:
                bucket = buckets[index]
                t0 = time.perf_counter()
                self.loader.load(unpack_bucket(
                    buffer,
                    [update_info.names[i] for i in bucket],
                    [update_info.shapes[i] for i in bucket],
                    [dtypes[i] for i in bucket],
                    [sizes[i] for i in bucket],
                ))
                t1 = time.perf_counter()
                parts["load_s"] += t1 - t0
                self._repack_completed([update_info.names[i] for i in bucket], owners, layers, left)
                parts["repack_during_s"] += time.perf_counter() - t1
                if shared and index + 1 < len(buckets):  # let the sender pack the next bucket into the segment
                    self._wait(self.group.barrier())
        self.loader.end(signature)
        LAST_UPDATE_PARTS.update({"receive_s": parts["receive_s"], "buckets": len(buckets),
                                  ("direct_copy_s" if direct else "load_weights_s"): parts["load_s"],
                                  "repack_during_s": parts["repack_during_s"]})

    def _wait(self, work) -> None:
        """Wait for a receive or barrier; stop as soon as the sender gave up on this update."""
        wait_work(work, self.timeout_s, self._sender_gave_up, check_every_s=SENDER_CHECK_EVERY_S)

    def _sender_gave_up(self) -> None:
        """Raise when the sender abandoned the update (GAVE_UP_KEY) or its store is gone (its process
        died): the buckets this engine waits on will never come."""
        try:
            gave_up = self.prefixed.check([GAVE_UP_KEY])
        except Exception as e:  # noqa: BLE001 - the store lives in the sender's process
            raise RuntimeError(f"the weight sender (learner rank 0) gave up on this update: its store no longer "
                               f"answers ({type(e).__name__}: {e}); the trainer re-initialises the transfer") from None
        if gave_up:
            raise RuntimeError("the weight sender (learner rank 0) gave up on this update (a peer failed or was "
                               "lost); the trainer re-initialises the transfer")

    def _broadcast_buckets(self, buckets: list[list[int]], sizes: list[int], reuse: bool, parts: dict):
        """(index, buffer) of each bucket as it arrives by broadcast; the receive of bucket k+1 is posted
        before bucket k is handed out, so it arrives (on gloo's own thread) while k is loaded. `reuse`:
        two kept buffers in turn (direct copies are done with a buffer when load() returns); otherwise a
        new one per bucket (vLLM's load_weights may keep a view). parts["receive_s"]: time waited."""
        def post(index: int):
            size = sum(sizes[i] for i in buckets[index])
            buffer = self._buffers.take(size) if reuse else torch.empty(size, dtype=torch.uint8)
            return self.group.broadcast(buffer, 0), buffer

        pending = post(0) if buckets else None
        for index in range(len(buckets)):
            t0 = time.perf_counter()
            work, buffer = pending
            self._wait(work)
            parts["receive_s"] += time.perf_counter() - t0
            # Bucket index+1 goes into the other buffer: the one index-1 was copied from, done with.
            pending = post(index + 1) if index + 1 < len(buckets) else None
            yield index, buffer

    def _shared_buckets(self, buckets: list[list[int]], sizes: list[int], keep: bool, parts: dict):
        """(index, segment bytes) of each bucket the sender announces (the caller's barrier frees the segment)."""
        for index, bucket in enumerate(buckets):
            t0 = time.perf_counter()
            buffer = self._receive_shared(index, sum(sizes[i] for i in bucket), keep)
            parts["receive_s"] += time.perf_counter() - t0
            yield index, buffer

    def _repack_completed(self, names: list[str], owners: dict[str, str], layers: dict, left: Counter) -> None:
        """Re-pack the CPU layers whose weight `names` (just loaded) completed."""
        for name in names:
            owner = owners.get(name)
            if owner not in left:
                continue
            left[owner] -= 1
            if left[owner] == 0:
                del left[owner]
                repack_layer(layers[owner])
                self.repacked.add(id(layers[owner]))

    def _receive_shared(self, index: int, size: int, keep: bool) -> torch.Tensor:
        """Wait for bucket `index`'s header, then its bytes in the segment (a copy of them unless
        `keep`: vLLM's load_weights may keep views, and the segment is overwritten next update)."""
        got = torch.zeros(2, dtype=torch.int64)
        self._wait(self.group.broadcast(got, 0))
        if not torch.equal(got, header(index, size)):
            raise RuntimeError(f"shared-memory weight transfer out of step: expected bucket {index} of {size} "
                               f"bytes, the sender announced bucket {int(got[0])} of {int(got[1])} bytes")
        return self.segment[:size] if keep else self.segment[:size].clone()

    def finish_weight_update(self) -> None:
        # vLLM's CPU linear layers compute from a packed copy made at load time: rebuild it
        # from the weights just loaded, or the engine keeps generating with the old ones.

        t0 = time.perf_counter()
        repack_cpu_weights(self.model, skip=self.repacked)  # those the buckets completed are done
        self.repacked = set()
        LAST_UPDATE_PARTS["repack_s"] = time.perf_counter() - t0

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.release()  # never blocks on a receive posted to a trainer that may be gone
        self.group, self.store, self.prefixed, self.rank, self.segment = None, None, None, None, None
