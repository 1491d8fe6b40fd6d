"""WeightSending: a learner rank's weights leaving it: to the engines, and as consolidated copies.

A part of learner/worker.py's LearnerWorker, mixed into its class rather than held by it: the driver
calls these methods on the rank's Ray handle, and Ray finds an actor's remote methods on its class.
It owns the trainer side of weight transfer (learner/weight_sync.py, which imports vLLM, so it is
imported on the first call, not with this module: a rank trains without vLLM until it syncs), and
reads the rank's DeepSpeed engine, rank and config (worker.py). The checkpoint part
(checkpoint_state.py) writes the adapter with `adapter_state_dict` and `_write_adapter`.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from actors.runtime.start_up import starts_with_few_full_collections
from actors.runtime.threads import use_threads
from learner.checkpoint import naming_save_errors
from learner.config import LearnerConfig
from learner.export import write_hf_dir
from learner.lora import adapter_config_json, write_adapter_dir
from learner.rank_setup import rank_barrier


class WeightSending:
    """init_weight_sync / sync_weights to the engines; whole weights, the adapter and an HF export."""

    # Of the rank (worker.py) and its thread count (ActorBase).
    cfg: LearnerConfig
    engine: Any
    rank: int
    model_path: str
    master_addr: str
    threads: int
    _transfer: Any = None  # trainer-side weight-transfer engine (learner/weight_sync.py), from init_weight_sync

    @starts_with_few_full_collections  # the first call imports vLLM's transfer API (actors/runtime/start_up.py)
    def init_weight_sync(self, rollout_handles: list, init_info: dict) -> None:
        """(Re)build the trainer-side transfer engine towards `rollout_handles`. Every rank is called."""
        from learner.weight_sync import weight_transfer
        # The sender (rank 0) listens for the engines where it listens for the other ranks: its
        # node's IP on a cluster, loopback when everything runs on one machine (cluster/launch/placement.py create_actors).
        init_info = {**init_info, "master_address": self.master_addr}
        if self._transfer is not None:
            self._transfer.shutdown()
        self._transfer = weight_transfer(self.engine.module, self.cfg, rank=self.rank, model_path=self.model_path,
                                         rollout_handles=rollout_handles, init_info=init_info)

    def sync_weights(self, version: int) -> dict:
        """Send the current weights to every engine; their weight version becomes `version`."""
        if self._transfer is None:
            raise RuntimeError("sync_weights called before init_weight_sync")
        use_threads(self.threads)
        return self._transfer.send(version)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Consolidated float32 weights on CPU (HF names) on rank 0, {} elsewhere. Collective."""
        return {k: v.float() for k, v in self._hf_state_dict().items()}

    def _hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Whole weights in their training dtype under HF names (LoRA: merged) on rank 0. Collective."""
        from learner.weight_sync import consolidated_state_dict, hf_source
        zero3 = self.cfg.zero_stage == 3
        return consolidated_state_dict(self.engine.module, zero3=zero3, rank=self.rank,
                                       source=hf_source(self.engine.module, zero3=zero3, rank=self.rank, lora=self.cfg.lora))

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter (peft names, as saved by peft) on rank 0, {} elsewhere. Collective."""
        from learner.weight_sync import adapter_source, consolidated_state_dict
        zero3 = self.cfg.zero_stage == 3
        return consolidated_state_dict(self.engine.module, zero3=zero3, rank=self.rank,
                                       source=adapter_source(self.engine.module, zero3=zero3, rank=self.rank))

    def export_hf(self, out_dir: str) -> None:
        """A plain HF model directory (safetensors + config + tokenizer); rank 0 writes. Collective."""
        sd = self._hf_state_dict()
        adapter = self.adapter_state_dict() if self.cfg.lora else {}
        if self.rank == 0:
            with naming_save_errors(out_dir):
                write_hf_dir(sd, out_dir, self.model_path)
                if self.cfg.lora:  # the adapter too, in peft format (PeftModel.from_pretrained)
                    self._write_adapter(adapter, os.path.join(out_dir, "adapter"))
        rank_barrier()

    def _write_adapter(self, tensors: dict, out_dir: str) -> None:
        write_adapter_dir(tensors, adapter_config_json(self.engine.module, self.model_path), out_dir)
