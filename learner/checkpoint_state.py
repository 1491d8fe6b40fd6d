"""CheckpointState: what a learner rank saves and restores (learner/checkpoint.py holds the formats and
the driver's side).

A part of learner/worker.py's LearnerWorker, mixed into its class rather than held by it: the driver
calls these methods on the rank's Ray handle, and Ray finds an actor's remote methods on its class.
It owns the rank's counters that a checkpoint carries (`step`, `nonfinite_streak`) and where the last
checkpoint is; it reads the DeepSpeed engine and config (worker.py) and writes the LoRA adapter with
the weight part's `adapter_state_dict` / `_write_adapter` (weight_sending.py).
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch

from learner import checkpoint
from learner.config import LearnerConfig
from learner.hf_dir import BASE_WEIGHTS
from learner.rank_setup import rank_barrier


class CheckpointState:
    """save_checkpoint / load_checkpoint of a rank, and what its optimizer holds."""

    # Of the rank (worker.py); adapter_state_dict and _write_adapter are the weight part's (weight_sending.py).
    cfg: LearnerConfig
    engine: Any
    rank: int
    model_path: str
    step: int = 0  # train_step calls completed (the driver's step on resume)
    nonfinite_streak: int = 0  # NaN/inf losses in a row (train_step raises at learner.max_nonfinite_steps)
    last_checkpoint: str | None = None
    base_weights: dict | None = None  # rank 0: model.path's weights_fingerprint when the rank loaded it

    def save_checkpoint(self, path: str, tag: str) -> None:
        """Model, optimizer and LR schedule (DeepSpeed's files) + this rank's RNG and counters (JSON)."""
        with checkpoint.naming_save_errors(path), checkpoint.without_zip_crc32():
            # LoRA: the frozen base stays out (DeepSpeed's exclude_frozen_parameters). DeepSpeed otherwise writes
            # it whole (ZeRO-0/1) or every rank's share of it (ZeRO-2/3) at every checkpoint and copies it back on
            # load: SmolLM2-135M's LoRA run, 539 of its checkpoint's 556 MB; a 7B base, 14 GB in bfloat16. The
            # ranks build the base from model.path before a load, and export merges the adapter into the base
            # there too (learner/export.py).
            self.engine.save_checkpoint(path, tag=tag, client_state={}, save_latest=False,
                                        exclude_frozen_parameters=self.cfg.lora)
            adapter = self.adapter_state_dict() if self.cfg.lora else {}
            if self.rank == 0:  # config + tokenizer, so the checkpoint exports on its own
                meta = os.path.join(path, checkpoint.HF_META_DIR)
                checkpoint.write_hf_meta(self.model_path, meta)
                # and the fingerprint of model.path's weights as rank 0 loaded them: a resume (LoRA's base, the
                # reference) and a LoRA export take weights from there, and are refused if they changed (hf_dir.py)
                with open(os.path.join(meta, BASE_WEIGHTS), "w") as f:
                    json.dump(self.base_weights, f)
                if self.cfg.lora:  # the adapter in peft format: export merges it into the base model
                    self._write_adapter(adapter, os.path.join(path, checkpoint.ADAPTER_DIR))
            checkpoint.write_worker_state(path, tag, self.rank, {
                "step": self.step, "nonfinite_streak": self.nonfinite_streak, "rng": checkpoint.rng_state()})
        self.last_checkpoint = checkpoint.final_path(path)  # where the driver's commit will put it
        rank_barrier()  # every rank's files are on disk before the driver commits

    def load_checkpoint(self, path: str, tag: str) -> None:
        """Restore what save_checkpoint wrote. Call on fresh workers (ZeRO-3 needs an unpartitioned start)."""
        with checkpoint.safe_torch_load():
            # LoRA: the module's saved state lacks the frozen base (save_checkpoint), hence not strict; the
            # trained adapter comes back from it and from the optimizer's float32 copies.
            load_path, _ = self.engine.load_checkpoint(path, tag=tag, load_optimizer_states=True,
                                                       load_lr_scheduler_states=True,
                                                       load_module_strict=not self.cfg.lora)
        if load_path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint with tag {tag!r} under {path}")
        state = checkpoint.read_worker_state(path, tag, self.rank)
        self.step, self.nonfinite_streak = state["step"], state["nonfinite_streak"]
        checkpoint.set_rng_state(state["rng"])
        self.last_checkpoint = path
        rank_barrier()

    def optimizer_state_bytes(self) -> int:
        """Bytes this rank's optimizer holds (Adam moments, and ZeRO's fp32 master partitions)."""
        opt = self.engine.optimizer
        inner = getattr(opt, "optimizer", opt)  # ZeRO wraps the torch optimizer
        tensors = [t for st in inner.state.values() for t in st.values() if torch.is_tensor(t)]
        tensors += [p for g in inner.param_groups for p in g["params"]]  # what it steps (ZeRO: fp32 partitions)
        return sum(t.numel() * t.element_size() for t in tensors)
