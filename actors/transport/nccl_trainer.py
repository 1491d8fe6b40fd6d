"""The sender of raygrpo's `nccl` backend: vLLM's NCCLTrainerWeightTransferEngine, its waits bounded.

vLLM's `send_weights` (the packed broadcast, the metadata check, the engines' update beside it) runs
unchanged. What changes:

- init: rank 0 binds its own port on its own node (`master_port` 0 in the driver's info, as the gloo
  backend does) and passes the listening socket to the TCPStore, instead of a port the driver found
  free on another host; the engines' join and the communicator's creation are bounded by `timeout_s`,
  and an engine whose init call fails ends the wait at once. Each engine gets its own rank offset
  (actors/transport/nccl.py engine_payloads, applied by the client).
- every broadcast runs under a Watchdog (nccl_protocol.py): past `timeout_s`, or as soon as the client
  reports an engine's call failed, the communicator is aborted and NcclWaitAborted names the engine
  and the wait. The group is then unusable; the driver builds it again (cluster/driver/engine_weights.py).
- shutdown aborts (never waits for peers that may be gone).

`register_nccl_backends` puts these classes under vLLM's own name `nccl` in both factories (the
learner here, every vLLM process through our general plugin), so rollout.weight_transfer_backend=nccl
means vLLM's NCCL code with these bounds.
"""
from __future__ import annotations

import importlib
import time
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient, WeightSource  # noqa: TID253 (vLLM side)
from vllm.distributed.weight_transfer.nccl_common import worker_init_payload  # noqa: TID253 (vLLM side)
from vllm.distributed.weight_transfer.nccl_engine import (  # noqa: TID253 (vLLM side)
    NCCLTrainerInitInfo,
    NCCLTrainerWeightTransferEngine,
)

from actors.runtime.process_groups import bind_listener
from actors.transport.nccl_protocol import (
    DEFAULT_TIMEOUT_S,
    PEER_ERROR_GRACE_S,
    Background,
    BoundedNcclInitInfo,
    NcclWaitAborted,
    Watchdog,
    communicator,
    release,
    release_when_formed,
)

BACKEND = "nccl"
ENGINE_MODULE, ENGINE_CLASS = "actors.transport.nccl_engine", "BoundedNcclWeightTransferEngine"
SENDER = "learner rank 0 (the weight sender)"


@dataclass
class BoundedNcclTrainerInitInfo(NCCLTrainerInitInfo):
    """vLLM's trainer-side NCCL init info, plus the bound of every wait. master_port 0: a free one on
    this (rank 0's) node."""

    backend: ClassVar[str] = BACKEND
    timeout_s: float = DEFAULT_TIMEOUT_S


class BoundedNcclTrainer(NCCLTrainerWeightTransferEngine):
    """vLLM's NCCL trainer engine with bounded waits (module docstring)."""

    init_info_cls = BoundedNcclTrainerInitInfo
    timeout_s: float = DEFAULT_TIMEOUT_S

    @classmethod
    def trainer_init(cls, init_info: BoundedNcclTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> BoundedNcclTrainer:
        if source is None:
            raise ValueError("NCCL trainer weight transfer requires a WeightSource.")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, packed=init_info.packed,
                     packed_buffer_size_bytes=init_info.packed_buffer_size_bytes,
                     packed_num_buffers=init_info.packed_num_buffers)
        engine.timeout_s = init_info.timeout_s
        if engine.is_sender:
            engine.model_update_group = _open_group(init_info, client)
        return engine

    def send_weights(self) -> None:
        if not self.is_sender:
            return super().send_weights()
        if self.model_update_group is None:
            raise RuntimeError("NCCL weight transfer: send_weights after an abort or shutdown; trainer_init again")
        dog = Watchdog(self.model_update_group, who=SENDER, what="the weight broadcast", timeout_s=self.timeout_s,
                       peer_failure=getattr(self.client, "peer_failure", None),
                       unfinished=getattr(self.client, "unfinished", None),
                       todo="The group is aborted; the driver builds it again with the live engines (raise "
                            "trainer.actor_timeout_s if the engines are slow, not dead)")
        try:
            with dog:
                super().send_weights()
        finally:
            if dog.reason is not None:
                self.model_update_group = None  # aborted by the watchdog: unusable

    def shutdown(self) -> None:
        release(self.model_update_group)
        self.model_update_group = None


def _open_group(init_info: BoundedNcclTrainerInitInfo, client: VLLMWeightSyncClient):
    """Rank 0's side of the rendezvous: bind, tell the engines (in a thread: they block until the group
    forms), build the communicator; both waits bounded by timeout_s."""
    from vllm.distributed.utils import StatelessProcessGroup

    host, timeout_s = init_info.master_address, init_info.timeout_s
    listener = bind_listener(host, init_info.master_port)
    port = listener.getsockname()[1]
    payload = worker_init_payload(BoundedNcclInitInfo(
        master_address=host, master_port=port, rank_offset=1, world_size=init_info.world_size,
        packed=init_info.packed, packed_buffer_size_bytes=init_info.packed_buffer_size_bytes,
        packed_num_buffers=init_info.packed_num_buffers, timeout_s=timeout_s))
    engines = Background(client.init_weight_transfer_engine, payload)

    def endpoint():
        group = StatelessProcessGroup.create(host=host, port=port, rank=0, world_size=init_info.world_size,
                                             store_timeout=max(1, int(timeout_s)), listen_socket=listener)
        return communicator(group, torch.accelerator.current_device_index())

    join = Background(endpoint)
    deadline = time.monotonic() + timeout_s
    while not join.done and time.monotonic() < deadline and not (engines.done and engines.error):
        time.sleep(0.01)
    if join.done and join.error is not None:
        raise NcclWaitAborted(f"NCCL weight transfer: {SENDER} could not open the group at {host}:{port}: "
                              f"{join.error}") from join.error
    if join.done:
        engines.thread.join(max(0.0, deadline - time.monotonic()))
        if engines.done and engines.error is None:
            return join.result
        release(join.result)
    else:
        Background(release_when_formed, join)  # a communicator that forms after this is let go at once
    engines.thread.join(PEER_ERROR_GRACE_S if engines.error is None else 0)
    why = (f"an engine's init failed: {engines.error}" if engines.error is not None
           else f"not all {init_info.world_size - 1} vLLM workers joined in {timeout_s:.0f}s")
    raise NcclWaitAborted(
        f"NCCL weight transfer: {SENDER} gave up forming the group at {host}:{port}: {why}. Check that the engines' "
        f"nodes reach {host} (README, Multi-node) and that world_size is 1 + engines x "
        f"rollout.tensor_parallel_size; the driver tries again with the live engines") from engines.error


def register_nccl_backends() -> None:
    """Put the bounded classes under vLLM's `nccl` in both factories (idempotent). vLLM registers its
    own lazily at import; its factories have no replace call, so the entry is overwritten."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    def engine_class():
        return getattr(importlib.import_module(ENGINE_MODULE), ENGINE_CLASS)

    WeightTransferEngineFactory._registry[BACKEND] = engine_class  # lazily: the trainer never needs it
    WeightTransferTrainerFactory._registry[BACKEND] = lambda: BoundedNcclTrainer
