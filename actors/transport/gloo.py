"""The CPU `gloo` backend (ours: vLLM's own backends all need CUDA), as the registry knows it.

Its parts: gloo_protocol.py (what both halves share: handshake, buckets, init and update infos),
gloo_trainer.py (the sender, in learner rank 0), gloo_engine.py (the receiver, in every vLLM
worker), shared_memory.py (the bytes through /dev/shm when sender and engines share a machine)
and direct_load.py (direct copies instead of vLLM's load_weights after the first update). This
module imports no vLLM; the halves do, and are loaded when weights move.
"""
from __future__ import annotations

from actors.transport.base import TransportBackend


class GlooBackend(TransportBackend):
    name = "gloo"

    def init_info(self, *, world_size: int, bucket_bytes: int, timeout_s: float) -> dict:
        # master_address: the sender fills in its own; port 0: it takes a free one there.
        return {"master_address": "", "master_port": 0, "world_size": world_size, "bucket_bytes": bucket_bytes,
                "timeout_s": timeout_s}

    def register(self) -> None:
        from actors.transport.gloo_trainer import register_engine_backend, register_trainer_backends

        register_engine_backend()
        register_trainer_backends()

    def transport(self, engine) -> str:
        return engine.transport()  # "shared_memory" when every engine mapped the sender's segment

    def fallback_note(self, engine) -> str:
        # why engines could not map the sender's shared-memory segment (then the bytes are broadcast)
        return f"no shared memory: {'; '.join(engine.refused)}" if engine.refused else ""
