"""vLLM's own `nccl` backend (engines on GPUs), as the registry knows it.

vLLM ships both halves (vllm/distributed/weight_transfer/nccl_engine.py); raygrpo runs them with its
bounds (nccl_trainer.py: the sender in learner rank 0, nccl_engine.py: the receiver in every vLLM
worker, registered under the same name `nccl`) and gives them their init info: port 0 (rank 0 binds
its own port on its own node, as the gloo backend does), packed buffers of rollout.bucket_mb, and
`timeout_s` for every wait.

Ranks: vLLM's worker takes rank `data_parallel_index * TP + tp_rank + rank_offset`
(nccl_common.py worker_init_process_group). Our engines are independent vLLM instances, each with
data-parallel index 0, so one payload sent to every engine would give every engine's first worker
rank 1. `engine_payloads` gives engine i its own `rank_offset = 1 + i * TP`: its workers are ranks
1 + i*TP .. i*TP + TP of a group of 1 + engines*TP.

No vLLM import here: the driver reads this module.
"""
from __future__ import annotations

from actors.transport.base import TransportBackend


class NcclBackend(TransportBackend):
    name = "nccl"

    def init_info(self, *, world_size: int, bucket_bytes: int, timeout_s: float) -> dict:
        # master_address: the sender fills in its own; port 0: it binds a free one there.
        return {"master_address": "", "master_port": 0, "world_size": world_size, "packed": True,
                "packed_buffer_size_bytes": bucket_bytes, "timeout_s": timeout_s}

    def register(self) -> None:
        from actors.transport.nccl_trainer import register_nccl_backends

        register_nccl_backends()


def engine_payloads(payload: dict, engines: int) -> list[dict]:
    """One init payload per engine, from the one a vLLM trainer engine fans out. A payload with an
    integer `rank_offset` (the NCCL convention: the workers' first rank) is given engine i's own offset,
    `rank_offset + i * workers_per_engine`, where workers_per_engine = (world_size - rank_offset) /
    engines; one without (gloo: ranks from a store counter) goes to every engine unchanged."""
    offset = payload.get("rank_offset")
    if not isinstance(offset, int) or engines <= 1:
        return [payload] * engines
    workers, rest = divmod(payload["world_size"] - offset, engines)
    if rest or workers < 1:
        raise ValueError(
            f"weight transfer init: world_size {payload['world_size']} is not {offset} + {engines} engines x "
            f"rollout.tensor_parallel_size workers; the driver's init info and the engines disagree "
            f"(is rollout.tensor_parallel_size the engines' own?)")
    return [{**payload, "rank_offset": offset + i * workers} for i in range(engines)]
