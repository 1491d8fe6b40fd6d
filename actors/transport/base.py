"""Weight transport: what raygrpo knows about one backend, on every side of a weight update.

The learner's weights reach running vLLM engines through vLLM's RL weight-transfer API: on each
side vLLM builds a transfer engine chosen by backend name, from factories a backend registers
with. The trainer side sends (`TrainerWeightTransferEngine.send_weights`, driven by a client over
the engines: client.py), the engine side receives (`WeightTransferEngine.update_weights`, inside
every vLLM worker). A `TransportBackend` holds the rest, one method per side:

  driver   init_info          the plain dict every learner rank gets (rank 0, the sender, fills
                              in the address it listens on);
  learner  trainer_init_info  vLLM's TrainerInitInfo for one rank, from that dict (vLLM's
                              `WeightTransferTrainerFactory.trainer_init` then builds the sender);
  engine   engine_config      the engine argument `weight_transfer_config`;
  both     register           make vLLM's factories know the backend in this process (our vLLM
                              plugin calls it in every vLLM process, the learner before it sends);
  reports  transport          how the bytes travel, and fallback_note: why not by a faster path.

registry.py names the backends (one module each: gloo.py, nccl.py). The LoRA adapter path
(lora_adapter.py) is not one of them: the adapter travels through Ray and the engine loads it
with vLLM's LoRA support.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

# Seconds of the parts of the last update this process's engine received (one engine per process:
# the engine runs in-process, actors/rollout.py); an engine-side backend fills it in, and
# RolloutWorker.apply_weight_update returns it with its own parts (the bench reports them).
LAST_UPDATE_PARTS: dict[str, float] = {}


class TransportBackend(ABC):
    """One weight-transfer backend of vLLM's RL API (see the module docstring)."""

    name: ClassVar[str]  # the backend's name in vLLM's factories and in rollout.weight_transfer_backend

    @abstractmethod
    def init_info(self, *, world_size: int, bucket_bytes: int, timeout_s: float) -> dict:
        """The driver's init info for every learner rank: world_size = 1 sender + every vLLM worker of
        every engine, `bucket_bytes` per packed buffer (rollout.bucket_mb), `timeout_s` per wait."""

    def register(self) -> None:
        """Make vLLM's engine and trainer factories know this backend in this process (idempotent)."""
        return None  # vLLM's built-in backends are known to its factories already

    def trainer_init_info(self, init_info: dict, rank: int):
        """vLLM's TrainerInitInfo of this backend for learner rank `rank`, from the driver's dict."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        self.register()
        registry = WeightTransferTrainerFactory._registry  # no public lookup of a backend's classes
        return registry[self.name]().init_info_cls(**init_info, rank=rank)

    def engine_config(self) -> dict:
        """The vLLM engine argument `weight_transfer_config` that selects this backend's receiver."""
        return {"backend": self.name}

    def transport(self, engine) -> str:
        """How the bytes travel with the trainer-side `engine` built for this backend."""
        return self.name

    def fallback_note(self, engine) -> str:
        """Why the bytes do not take a faster path this backend has ("" when they do, or it has none)."""
        return ""
