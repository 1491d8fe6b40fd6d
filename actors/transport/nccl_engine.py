"""The receiver of raygrpo's `nccl` backend, in every vLLM worker: vLLM's NCCLWeightTransferEngine
(its rank arithmetic, packed receive and layerwise load run unchanged) with bounded waits.

- init: a communicator left from an earlier group is aborted first (vLLM's overwrote it, and the old one
  stayed alive: nccl_engine.py `init_transfer_engine`); the join is bounded by the init info's `timeout_s`
  (a communicator that forms after that is aborted at once);
- every receive runs under a Watchdog (nccl_protocol.py): past `timeout_s` the communicator is aborted
  and the update fails with NcclWaitAborted, naming this worker's rank and the wait (the sender died or
  gave up: the driver builds the group again);
- shutdown aborts.

Registered under `nccl` by actors/transport/nccl_trainer.py `register_nccl_backends` (our vLLM plugin
calls it in every vLLM process).
"""
from __future__ import annotations

import time

from vllm.distributed.weight_transfer.nccl_common import worker_init_process_group  # noqa: TID253 (vLLM side)
from vllm.distributed.weight_transfer.nccl_engine import (  # noqa: TID253 (vLLM side)
    NCCLWeightTransferEngine,
    NCCLWeightTransferUpdateInfo,
)

from actors.transport.nccl_protocol import (
    DEFAULT_TIMEOUT_S,
    Background,
    BoundedNcclInitInfo,
    NcclWaitAborted,
    Watchdog,
    release,
    release_when_formed,
)

TODO = ("The group is aborted; the driver builds it again (if learner rank 0 is alive and only slow, raise "
        "trainer.actor_timeout_s)")


class BoundedNcclWeightTransferEngine(NCCLWeightTransferEngine):
    """vLLM's NCCL receiver with bounded waits (module docstring)."""

    init_info_cls = BoundedNcclInitInfo
    timeout_s: float = DEFAULT_TIMEOUT_S

    def init_transfer_engine(self, init_info: BoundedNcclInitInfo) -> None:
        self.shutdown()  # the previous group's communicator, if any: aborted, not leaked
        self.timeout_s = init_info.timeout_s
        self.packed = init_info.packed
        self.packed_buffer_size_bytes = init_info.packed_buffer_size_bytes
        self.packed_num_buffers = init_info.packed_num_buffers
        join = Background(worker_init_process_group, init_info, self.parallel_config)
        join.thread.join(self.timeout_s)
        if join.done and join.error is None:
            self.model_update_group = join.result
            return
        if not join.done:
            Background(release_when_formed, join)
        raise NcclWaitAborted(
            f"NCCL weight transfer: vLLM worker {self.parallel_config.rank} of this engine (rank offset "
            f"{init_info.rank_offset}) could not join the group at {init_info.master_address}:"
            f"{init_info.master_port} of world size {init_info.world_size} in {self.timeout_s:.0f}s"
            + (f": {join.error}" if join.error is not None else "")
            + ". Check that this node reaches learner rank 0's address (README, Multi-node)") from join.error

    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo) -> None:
        comm = self.model_update_group
        if comm is None:
            return super().receive_weights(update_info)  # vLLM's own error: not initialised
        rank = getattr(comm, "rank", "?")
        dog = Watchdog(comm, who=f"vLLM worker at NCCL rank {rank}", what="the receive of a weight update from "
                       "learner rank 0", timeout_s=self.timeout_s, todo=TODO)
        t0 = time.monotonic()
        try:
            with dog:
                super().receive_weights(update_info)
        finally:
            if dog.reason is not None:
                self.model_update_group = None
        self.last_receive_s = time.monotonic() - t0

    def shutdown(self) -> None:
        release(self.model_update_group)
        self.model_update_group = None
