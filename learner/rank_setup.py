"""Setting up one learner rank: its torch.distributed world, the DeepSpeed config, the model it
trains, AdamW's parameter groups, the LR schedule and the seeds (learner/worker.py runs the rank)."""
from __future__ import annotations

import math
import os
import random
import sys
import types

import numpy as np
import torch
import torch.distributed as dist

from actors.runtime.devices import resolve_dtype
from actors.runtime.process_groups import listening_store
from actors.runtime.sockets import PortBoard, interface_of, local_ip_towards, reach
from learner.config import LearnerConfig
from learner.lora import apply_lora


def lr_factor(update: int, *, warmup: int, total: int, schedule: str) -> float:
    """Multiplier of the base LR before optimizer update `update` (0-based): linear warm-up,
    then constant / linear to 0 / cosine to 0 at `total`."""
    if warmup > 0 and update < warmup:
        return (update + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (update - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def scheduler_factory(cfg: LearnerConfig, total_steps: int):
    """What DeepSpeed builds the LR schedule with: lr_factor over optimizer updates (the LR moves
    once per update, mu per step)."""
    warmup, horizon = cfg.warmup_steps * cfg.mu, total_steps * cfg.mu

    def make_scheduler(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda u: lr_factor(u, warmup=warmup, total=horizon, schedule=cfg.lr_schedule))

    return make_scheduler


def build_model(model_path: str, cfg: LearnerConfig, dtype: torch.dtype, ds_config: dict):
    """The model this rank trains, in train mode: with gradient checkpointing and LoRA adapters as
    configured. Under ZeRO-3 its weights load straight into partitions: returns (model,
    HfDeepSpeedConfig), which must stay referenced while the model lives (transformers keeps a
    weakref); else (model, None)."""
    from transformers import AutoModelForCausalLM

    hf_ds_config = None
    if cfg.zero_stage == 3:  # must exist before from_pretrained (DESIGN.md)
        from transformers.integrations import HfDeepSpeedConfig

        hf_ds_config = HfDeepSpeedConfig(ds_config)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    model.config.use_cache = False
    if cfg.gradient_checkpointing:
        # peft + ZeRO-3 needs reentrant checkpointing, and then inputs that require grad
        # (frozen embeddings would otherwise cut the graph); DESIGN.md.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": cfg.lora})
        if cfg.lora:
            model.enable_input_require_grads()
    if cfg.lora:
        model = apply_lora(model, cfg)
    model.train()
    return model, hf_ds_config


def build_ds_config(cfg: LearnerConfig, *, world_size: int, on_gpu: bool) -> dict:
    """The DeepSpeed config for `cfg`. Batch sizes are nominal: we feed micro-batches ourselves."""
    bf16 = resolve_dtype(cfg.dtype, on_gpu) == "bfloat16"
    zero: dict = {"stage": cfg.zero_stage}
    if cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
    if cfg.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": on_gpu}
    if cfg.zero_stage == 3:
        # We consolidate weights ourselves (layer by layer) for sync and export.
        zero["stage3_gather_16bit_weights_on_model_save"] = False
        zero["stage3_param_persistence_threshold"] = cfg.zero3_param_persistence_threshold
        zero["stage3_max_reuse_distance"] = cfg.zero3_max_reuse_distance
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": 1,  # the boundary is set by hand, see train_step
        "train_batch_size": cfg.micro_batch_size * world_size,
        "gradient_clipping": cfg.grad_clip,
        "optimizer": {
            "type": "AdamW",
            # torch.optim.AdamW: DeepSpeed's fused/CPU Adam need compiled ops (and a GPU for fused).
            # torch's own fused kernel (CPU and CUDA): DeepSpeed passes foreach=None, which on CPU means
            # one tensor at a time, 0.52 s a step for SmolLM2's 134.5M parameters against 0.066 s fused.
            "params": {"lr": cfg.lr, "betas": [cfg.adam_beta1, cfg.adam_beta2], "eps": cfg.adam_eps,
                       "weight_decay": cfg.weight_decay, "torch_adam": True, "fused": True},
        },
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        # bf16 keeps 8 mantissa bits: summed in bf16, a micro-batch's gradient below 1/256 of the running sum is
        # lost. float32 accumulation: DeepSpeed's BF16 optimizer at stage 1, float32 gradient partitions at 2
        # and 3 (engine._do_optimizer_sanity_check; stage 0 refuses it: learner.zero_stage's check).
        **({"data_types": {"grad_accum_dtype": "fp32"}} if bf16 else {}),
        "fp16": {"enabled": False},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,  # torch AdamW with optimizer offload is fine
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: no weight decay on biases and norm weights (1-D tensors), as HF Trainer does."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        ndim = len(p.ds_shape) if hasattr(p, "ds_shape") else p.dim()  # ZeRO-3 params are flat shards
        (no_decay if ndim < 2 else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def rendezvous_store(master_addr: str, master_port: int, rank: int, world_size: int, timeout, *, port_key: str = "",
                     board: PortBoard | None = None, connect_timeout_s: float | None = None, master_host: str = ""):
    """This rank's end of the ranks' rendezvous store on `master_addr`. With `port_key` (what a run passes),
    rank 0 listens on a port the OS picks in its own process and posts it on `board` (Ray's key-value store)
    under that key, and the others read it there: nothing else on the node can take the port in between.
    Without it (a test's own ranks), `master_port` as given; a lone rank listens on any free port."""
    board = board or PortBoard()
    if rank == 0:
        store = listening_store(master_addr, 0 if port_key or world_size == 1 else master_port, timeout)
        if port_key and world_size > 1:
            board.publish(port_key, store.port)
        return store
    if port_key:
        master_port = board.wait(port_key, timeout.total_seconds(), f"learner rank {rank}")
    if connect_timeout_s is not None:
        reach(master_addr, master_port, connect_timeout_s, f"learner rank {rank}",
              f"learner rank 0's rendezvous{f' on {master_host}' if master_host else ''}")
    return dist.TCPStore(master_addr, master_port, is_master=False, timeout=timeout)


def init_process_group(on_gpu: bool, master_addr: str, master_port: int, rank: int, world_size: int,
                       connect_timeout_s: float | None = None, master_host: str = "", port_key: str = "") -> int:
    """The ranks' torch.distributed world, listening on `master_addr` only: rank 0 serves the
    rendezvous store there (torch's env:// store would listen on every interface), and gloo's
    own sockets use the interface that holds this node's address on the way to it. Returns the store's port.

    Another rank first makes sure rank 0's host answers at `master_addr` (`connect_timeout_s`,
    ray.connect_timeout_s; None: no such check): torch's store would retry an unreachable address for its
    whole timeout (30 minutes) and then say only that it timed out. `master_host`: rank 0's hostname, for
    the error. `port_key`: rendezvous_store."""
    from deepspeed.constants import default_pg_timeout

    timeout = default_pg_timeout  # what deepspeed.init_distributed would use
    store = rendezvous_store(master_addr, master_port, rank, world_size, timeout, port_key=port_key,
                             connect_timeout_s=connect_timeout_s, master_host=master_host)
    if not on_gpu and not os.environ.get("GLOO_SOCKET_IFNAME"):
        ifname = interface_of(local_ip_towards(master_addr))
        if ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
    dist.init_process_group("nccl" if on_gpu else "gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timeout)
    return store.port


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# DeepSpeed imports its Muon optimizer's module wherever it asks "is this optimizer Muon?" (ZeRO's supported-optimizer
# check, the ZeRO-1/2/3 and bf16 optimizers' constructors, ZeRO-2's gradient averaging); that module wraps its kernels
# in torch.compile at import, which imports torch's inductor: about a fifth of a CPU learner rank's construction
# (10-11 -> 8 CPU-s beside other work on the tiny model; the import alone 5.6 CPU-s, 3.2 with torch.compile off).
# The learner's optimizer is always torch's AdamW (build_ds_config), so every such check is answered "no" without
# it: a module of that name whose MuonWithAuxAdam no optimizer is an instance of.
DEEPSPEED_MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


class NotLoadedMuon:
    """Stands for DeepSpeed's MuonWithAuxAdam in a learner rank, which never builds one (no optimizer is an instance)."""


def skip_deepspeed_muon() -> None:
    """Before deepspeed.initialize: DeepSpeed's Muon module (see DEEPSPEED_MUON_MODULE) is not imported in this
    process; where it already is, nothing changes."""
    if DEEPSPEED_MUON_MODULE not in sys.modules:
        stub = types.ModuleType(DEEPSPEED_MUON_MODULE, "raygrpo: DeepSpeed's Muon optimizer, not loaded (learner/rank_setup.py)")
        stub.MuonWithAuxAdam = NotLoadedMuon
        sys.modules[DEEPSPEED_MUON_MODULE] = stub


# DeepSpeed's shared-memory C++ op. deepspeed.init_distributed on a CPU rank JIT-compiles it when no build is cached
# (about a minute, silent; a build killed part-way left a lock every later rank waited on) and loads it. Only
# DeepSpeed's inference all-reduce uses it (tensor-parallel layers, deepspeed/module_inject); ZeRO's collectives
# go through torch.distributed. Its one reader of "may it be built" (deepspeed/comm/torch.py build_shm_op) asks
# deepspeed.ops.__compatible_ops__, whose first access probes every op DeepSpeed has (compiler subprocesses).
DEEPSPEED_SHM_OP = "deepspeed_shm_comm"


def skip_deepspeed_shm_op() -> None:
    """Before deepspeed.init_distributed: the shared-memory op is neither built nor loaded, and no op is probed
    (where DeepSpeed probed them already, the op is only marked off)."""
    import deepspeed.ops

    probed = deepspeed.ops.__dict__.get("__compatible_ops__")
    if probed is None:
        deepspeed.ops.__compatible_ops__ = {DEEPSPEED_SHM_OP: False}
    else:
        probed[DEEPSPEED_SHM_OP] = False


def rank_barrier() -> None:
    """Every rank of the learner's group waits here for the others (after a collective write to disk)."""
    import deepspeed.comm as dist

    dist.barrier()
