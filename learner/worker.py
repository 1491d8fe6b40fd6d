"""LearnerWorker: one DeepSpeed rank. The driver wraps the class with ray.remote, one actor per rank.

Single-controller style (as in verl): the driver calls a few coarse methods on every rank
at once (train_step, sync_weights, save/load_checkpoint, export_hf) and the ranks meet
inside those calls in DeepSpeed's collectives. Every rank must therefore get every call,
in the same order.

The rank is made of parts, one concern each: training_step.py (train_step, exact micro-batching,
lent threads), weight_sending.py (weights to the engines, consolidated copies, the HF export) and
checkpoint_state.py (what a checkpoint saves and restores); what every actor answers (info, network,
threads) comes from actors/runtime/actor_base.py. The parts are mixed into this class, not held by
it, because Ray finds an actor's remote methods on its class. This module sets the rank up: its
process group (rank_setup.py), its model and DeepSpeed engine.
"""
from __future__ import annotations

import os
import time

import torch

from actors.runtime.actor_base import ActorBase
from actors.runtime.devices import on_gpu, resolve_dtype
from actors.runtime.start_ledger import LEARNER_GROUP, record_start
from actors.runtime.start_up import starts_with_few_full_collections
from actors.runtime.threads import use_threads
from learner.checkpoint_state import CheckpointState
from learner.config import AlgoConfig, LearnerConfig
from learner.forward import call_at_every_block
from learner.hf_dir import weights_fingerprint
from learner.lora import param_counts
from learner.peak_memory import PeakMemory
from learner.rank_setup import (
    build_ds_config,
    build_model,
    init_process_group,
    param_groups,
    scheduler_factory,
    seed_everything,
    skip_deepspeed_muon,
    skip_deepspeed_shm_op,
)
from learner.training_step import TrainingStep
from learner.weight_sending import WeightSending


class LearnerWorker(ActorBase, TrainingStep, WeightSending, CheckpointState):
    """One DeepSpeed rank (a Ray actor). See the module docstring for the calling contract."""

    @starts_with_few_full_collections  # its imports: actors/runtime/start_up.py
    def __init__(self, model_path: str, cfg: LearnerConfig, algo: AlgoConfig, *, rank: int, world_size: int,
                 master_addr: str, master_port: int, total_steps: int, seed: int, reference_on_learner: bool = False,
                 master_host: str = "", connect_timeout_s: float | None = None, port_key: str = ""):
        """`reference_on_learner`: this rank computes the reference log-probs of its shard itself
        (RunConfig.reference_on_learner): with LoRA from its base model, adapters off; else from a
        frozen copy of the starting model that it holds. `master_host`, `connect_timeout_s`: rank 0's
        hostname and how long another rank waits for rank 0's host to answer at `master_addr`
        (rank_setup.init_process_group; a run passes ray.connect_timeout_s). `port_key`: where rank 0 posts the
        port it bound and the others read it (rank_setup.rendezvous_store; a run passes it, `master_port` 0)."""
        if rank == 0:  # one line per group started (the test suite's cost file; a no-op in a user's run)
            record_start(LEARNER_GROUP, world_size=world_size)
        skip_deepspeed_muon()  # before DeepSpeed asks whether the optimizer is Muon (rank_setup.py: why)
        import deepspeed
        from transformers import AutoModelForCausalLM

        t0 = time.perf_counter()
        self.threads = cfg.threads  # until the driver's thread budget arrives (set_threads)
        use_threads(self.threads)
        self.cfg, self.algo, self.model_path = cfg, algo, str(model_path)
        self.rank, self.world_size, self.total_steps, self.seed = rank, world_size, total_steps, seed
        self.master_addr = master_addr
        self.on_gpu = on_gpu(cfg.num_gpus)
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.on_gpu else torch.device("cpu")
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                          WORLD_SIZE=str(world_size),
                          # Ray gives each rank its own device(s), so the rank is local rank 0 there.
                          LOCAL_RANK="0")
        self.pinned_ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")  # before init sets it from the route
        master_port = init_process_group(self.on_gpu, master_addr, master_port, rank, world_size, connect_timeout_s,
                                         master_host, port_key)
        os.environ["MASTER_PORT"] = str(master_port)  # the port bound, where rank 0 picked it
        skip_deepspeed_shm_op()  # an op the learner never uses, compiled the first time (rank_setup.py: why)
        # DeepSpeed adopts the group made above (it initializes torch.distributed only if nobody did)
        deepspeed.init_distributed(dist_backend="nccl" if self.on_gpu else "gloo", auto_mpi_discovery=False,
                                   rank=rank, world_size=world_size, verbose=False)
        seed_everything(seed)  # the same seed on every rank: any random init must agree across ranks

        self.ds_config = build_ds_config(cfg, world_size=world_size, on_gpu=self.on_gpu)
        dtype = getattr(torch, resolve_dtype(cfg.dtype, self.on_gpu))
        self.reference_on_learner, self.reference = reference_on_learner, None
        self._memory = PeakMemory(self.on_gpu)  # before any weights load: the step line's learner_peak_bytes
        if reference_on_learner and not cfg.lora:  # loaded before ZeRO-3's config exists: a whole, unpartitioned copy
            self.reference = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype).to(self.device)
            self.reference.eval().requires_grad_(False)
        # _hf_ds_config (ZeRO-3) must stay referenced while the model lives: transformers keeps a weakref.
        model, self._hf_ds_config = build_model(self.model_path, cfg, dtype, self.ds_config)
        # what model.path held as the rank loaded it, into every checkpoint (checkpoint_state.py: why)
        self.base_weights = weights_fingerprint(self.model_path) if rank == 0 else None
        # Prompt sharing needs the model's KV cache in training: gradient checkpointing turns it off,
        # and under ZeRO-3 the second pass would gather every parameter again.
        self.share_prompts = cfg.prompt_sharing and not cfg.gradient_checkpointing and cfg.zero_stage != 3
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, cfg.weight_decay),
                                               config=self.ds_config,
                                               lr_scheduler=scheduler_factory(cfg, total_steps))
        if not self.on_gpu:
            call_at_every_block(model, self._step_threads)  # lent threads are taken mid-micro-batch
        # train_calls, step, nonfinite_streak, the weight transfer: the parts' starting values (their class bodies)
        self.init_seconds = time.perf_counter() - t0
        self.param_counts = param_counts(self.engine.module)
        # ZeRO-3: how many parameter tensors are partitioned over the ranks (the rest persist whole: ds_persist)
        params = list(self.engine.module.parameters())
        self.param_counts.update(param_tensors=len(params),
                                 partitioned_params=sum(getattr(p, "ds_persist", True) is False for p in params))
        if rank == 0:
            c = self.param_counts
            print(f"learner: {c['trainable_params']:,} trainable of {c['total_params']:,} parameters "
                  f"({100 * c['trainable_params'] / c['total_params']:.2f}%"
                  f"{f', LoRA rank {cfg.lora_rank}' if cfg.lora else ''}); {self._forward_kind()}", flush=True)

    def own_info(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "device": str(self.device),
                "zero_stage": self.cfg.zero_stage, "init_seconds": self.init_seconds, "step": self.step,
                "lora_rank": self.cfg.lora_rank,
                "listen_address": self.master_addr,  # rank 0's rendezvous and weight-transfer listeners
                **self.param_counts}
