"""vLLM's own `nccl` backend (engines on GPUs), as the registry knows it. vLLM ships both halves
(vllm/distributed/weight_transfer/nccl_engine.py); raygrpo gives it its init info: a port the
driver picks, and packed buffers of rollout.bucket_mb."""
from __future__ import annotations

from actors.runtime.sockets import free_port
from actors.transport.base import TransportBackend


class NcclBackend(TransportBackend):
    name = "nccl"

    def init_info(self, *, world_size: int, bucket_bytes: int, timeout_s: float) -> dict:
        # master_address: the sender fills in its own.
        return {"master_address": "", "master_port": free_port(), "world_size": world_size, "packed": True,
                "packed_buffer_size_bytes": bucket_bytes}
