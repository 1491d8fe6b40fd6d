"""LearnerWorker: one DeepSpeed rank. The driver wraps the class with ray.remote, one actor per rank.

Single-controller style (as in verl): the driver calls a few coarse methods on every rank
at once (train_step, sync_weights, save/load_checkpoint, export_hf) and the ranks meet
inside those calls in DeepSpeed's collectives. Every rank must therefore get every call,
in the same order.

Exact micro-batching. Each rank trains on its contiguous 1/W of the batch, in micro-batches
of cfg.micro_batch_size, with ONE optimizer step per pass over the batch. Each micro-batch
loss is its share of the full-batch loss (policy_loss with the GLOBAL token/sequence counts
divided by W, because DeepSpeed averages gradients over the W ranks), DeepSpeed's own
gradient-accumulation scaling is off (GAS=1, backward(scale_wrt_gas=False)) and the
accumulation boundary is set by hand on the last micro-batch, so the update equals one
full-batch step in plain torch (tests/e2e/test_learner.py checks this to 1e-5).
"""
from __future__ import annotations

import math
import os
import socket
import time

import torch

from actors.runtime.devices import on_gpu, resolve_dtype
from actors.runtime.sockets import network_view
from actors.runtime.start_ledger import LEARNER_GROUP, record_start
from actors.runtime.start_up import starts_with_few_full_collections
from actors.runtime.threads import node_cores, use_threads
from learner import checkpoint, grpo
from learner.batch import MicroBatch, TrainBatch
from learner.checkpoint import naming_save_errors
from learner.config import AlgoConfig, LearnerConfig
from learner.export import write_hf_dir
from learner.forward import call_at_every_block, completion_logits, logprobs_and_entropy
from learner.lora import adapter_config_json, param_counts, write_adapter_dir
from learner.op_build import build_dir, check_shm_op_build, environment_ninja
from learner.peak_memory import PeakMemory
from learner.rank_setup import (
    build_ds_config,
    build_model,
    init_process_group,
    param_groups,
    scheduler_factory,
    seed_everything,
    skip_deepspeed_muon,
)
from learner.sequences import PromptSharingUnsupported

# policy_loss's metrics that are token-weighted means over the whole batch (summed as value * tokens,
# then / tokens, averaged over the mu passes). Entropy and logprob_diff_mean are too, measured on the first pass only.
_TOKEN_MEAN_METRICS = ("clip_frac", "ratio_mean", "kl", "tis_weight_mean")


class LearnerWorker:
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
        self.train_calls = 0  # train_step calls on this actor (lend_threads names one; not checkpointed)
        self._lent = (-1, 0)  # (train call, threads): lend_threads' offer for that call
        self._threads_max = 0  # the most threads the current train step used
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
        if not self.on_gpu:  # DeepSpeed compiles its shared-memory op here once: say so; a stale lock is an error
            check_shm_op_build(build_dir())
        # DeepSpeed adopts the group made above (it initializes torch.distributed only if nobody did)
        with environment_ninja():
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
        # Prompt sharing needs the model's KV cache in training: gradient checkpointing turns it off,
        # and under ZeRO-3 the second pass would gather every parameter again.
        self.share_prompts = cfg.prompt_sharing and not cfg.gradient_checkpointing and cfg.zero_stage != 3
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, cfg.weight_decay),
                                               config=self.ds_config,
                                               lr_scheduler=scheduler_factory(cfg, total_steps))
        self.step = 0  # train_step calls completed (the driver's step on resume)
        if not self.on_gpu:
            call_at_every_block(model, self._step_threads)  # lent threads are taken mid-micro-batch
        self.nonfinite_streak = 0
        self.last_checkpoint: str | None = None
        self._transfer = None  # trainer-side weight-transfer engine (learner/weight_sync.py)
        self.init_seconds = time.perf_counter() - t0
        self.param_counts = param_counts(self.engine.module)
        if rank == 0:
            c = self.param_counts
            print(f"learner: {c['trainable_params']:,} trainable of {c['total_params']:,} parameters "
                  f"({100 * c['trainable_params'] / c['total_params']:.2f}%"
                  f"{f', LoRA rank {cfg.lora_rank}' if cfg.lora else ''}); {self._forward_kind()}", flush=True)

    # ------------------------------------------------------------------ #
    # small helpers
    # ------------------------------------------------------------------ #
    def info(self) -> dict:
        node_id = None
        try:
            import ray
            node_id = ray.get_runtime_context().get_node_id()
        except Exception:  # not inside Ray (a plain process in a test)
            pass
        return {"rank": self.rank, "world_size": self.world_size, "pid": os.getpid(), "node_id": node_id,
                "hostname": socket.gethostname(), "device": str(self.device), "zero_stage": self.cfg.zero_stage,
                "init_seconds": self.init_seconds, "step": self.step, "lora_rank": self.cfg.lora_rank,
                "listen_address": self.master_addr,  # rank 0's rendezvous and weight-transfer listeners
                "cores": node_cores(), "torch_threads": torch.get_num_threads(), **self.param_counts}

    def network(self, towards: str) -> dict:
        """This rank's host, advertised address and gloo interface (placement.json, the console)."""
        return network_view(towards, self.pinned_ifname)

    def set_threads(self, n: int) -> None:
        """The torch threads this rank computes with from now on (the driver's thread budget)."""
        self.threads = n
        use_threads(n)

    def lend_threads(self, call: int, n: int) -> None:
        """The collecting side of this node is idle until train_step call number `call` (0-based,
        this actor's) ends: use n threads for the rest of it (cluster/launch/thread_budget.py
        idle_collect_threads). Called while train_step runs, in a concurrency group of its own;
        train_step applies it at its next decoder layer and returns to its own count when it
        ends. An offer for a call that is over is never used."""
        self._lent = (call, n)

    def _step_threads(self) -> None:
        """Set the threads for the next piece of the current train step: the lent ones if offered for it."""
        call, n = self._lent
        use_threads(n if call == self.train_calls and n > self.threads else self.threads)
        self._threads_max = max(self._threads_max, torch.get_num_threads())

    def _all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        import deepspeed.comm as dist
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return t.tolist()

    def _forward_kind(self) -> str:
        packed = " (packed, learner.pack_sequences)" if self.cfg.pack_sequences else ""
        if self.share_prompts:
            return "the completions of a prompt share its forward pass" + (", else one row per micro-batch" + packed
                                                                          if packed else "")
        why = " (prompt sharing needs no gradient checkpointing and ZeRO-0/1/2)" if self.cfg.prompt_sharing else ""
        return ("one row per micro-batch" + packed if packed else "one forward pass per sequence") + why

    def _forward(self, mb: MicroBatch, with_entropy: bool, model=None):
        """Log-probs [n, C] of the completion tokens under `model` (by default the one being trained),
        and optionally their entropy (learner/forward.py)."""
        model = model or self.engine
        try:
            logits, targets = completion_logits(model, mb, self.device, self.share_prompts, self.cfg.pack_sequences)
        except PromptSharingUnsupported as e:
            self.share_prompts = False
            print(f"learner: prompt sharing is off from now on ({e}); one forward pass per sequence", flush=True)
            logits, targets = completion_logits(model, mb, self.device, False, self.cfg.pack_sequences)
        return logprobs_and_entropy(logits, targets, with_entropy)

    # ------------------------------------------------------------------ #
    # training
    # ------------------------------------------------------------------ #
    def train_step(self, batch: TrainBatch) -> dict:
        """mu optimisation passes over `batch` (the full batch; this rank takes its shard). Returns metrics,
        identical on every rank (averaged / summed over ranks)."""
        t0 = time.perf_counter()
        use_threads(self.threads)
        batch.validate()
        cfg, algo = self.cfg, self.algo
        shard = batch.shard(self.rank, self.world_size)
        num_tokens = batch.num_completion_tokens() / self.world_size
        num_seqs = batch.num_trained_sequences() / self.world_size
        norm_length = batch.norm_length()  # Dr. GRPO's constant normaliser (read by seq-mean-token-sum-norm)
        mbs = shard.micro_batches(cfg.micro_batch_size, by_length=True, share_prompts=self.share_prompts)  # same loss
        to = lambda x: None if x is None else x.to(self.device)  # noqa: E731

        ref_logps, ref_seconds = None, 0.0
        if self.reference_on_learner and algo.beta > 0 and batch.ref_logp is None:
            ref_logps = self._reference_logps(mbs)
            ref_seconds = time.perf_counter() - t0
        old_logps = None
        if cfg.mu > 1:  # pi_old is the policy before the first of the mu updates
            with torch.no_grad():
                old_logps = [self._forward(mb, with_entropy=False)[0] for mb in mbs]

        sums = {k: 0.0 for k in ("loss", "pg_loss", *_TOKEN_MEAN_METRICS, "entropy", "logprob_diff_mean")}
        grad_norm, lr, passes, skipped = 0.0, self.engine.get_lr()[0], 0, False
        diff_max = 0.0  # largest |learner - vLLM| log-prob of a sampled token, before any update
        self._threads_max = 0
        for k in range(cfg.mu):
            lr = self.engine.get_lr()[0]
            for j, mb in enumerate(mbs):
                self._step_threads()
                self.engine.set_gradient_accumulation_boundary(j == len(mbs) - 1)
                logp, entropy = self._forward(mb, with_entropy=(k == 0))
                old = logp.detach() if old_logps is None else old_logps[j]
                mask = to(mb.mask)
                ref = to(mb.ref_logp) if ref_logps is None else ref_logps[j]
                loss, m = grpo.policy_loss(grpo.LossInputs(
                    logp, old, to(mb.advantages), mask, ref_logp=ref, behavior_logp=to(mb.behavior_logp),
                    num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length), algo)
                if not torch.isfinite(loss):
                    # A NaN/inf loss can still give finite gradients (e.g. k3 KL with ref_logp=-inf).
                    # Poison the gradients so DeepSpeed's overflow check skips the update on every
                    # rank (it all-reduces the check), keeping its bookkeeping consistent.
                    loss = loss * float("nan")
                self.engine.backward(loss, scale_wrt_gas=False)
                tokens = float(mb.mask.sum())
                sums["loss"] += float(loss.detach())
                sums["pg_loss"] += m["pg_loss"]
                for name in _TOKEN_MEAN_METRICS:
                    if name in m:
                        sums[name] += m[name] * tokens
                if entropy is not None:  # k == 0: the policy that sampled, before the first update of the step
                    sums["entropy"] += float(grpo.masked_mean(entropy, mask)) * tokens
                    diff = (logp.detach() - to(mb.behavior_logp)).abs() * mask
                    sums["logprob_diff_mean"] += float(diff.sum())
                    diff_max = max(diff_max, float(diff.max()) if diff.numel() else 0.0)
            self._step_threads()
            grad_norm, applied = self._optimizer_step()
            passes += 1
            if not applied:  # the same on every rank (the overflow check is all-reduced)
                skipped = True
                break  # a batch that gave NaN/inf once will again: no further passes on it

        self.step += 1
        self.train_calls += 1
        use_threads(self.threads)  # lent threads go back with the step
        self.nonfinite_streak = self.nonfinite_streak + 1 if skipped else 0
        metrics = self._reduce_metrics(sums, passes, batch.num_completion_tokens())
        metrics["logprob_diff_max"], threads_max, metrics["learner_peak_bytes"] = self._all_reduce(
            [diff_max, self._threads_max, self._memory.peak_bytes()], op="max")
        metrics.update(grad_norm=grad_norm, lr=lr, tokens=batch.num_completion_tokens(), skipped=skipped,
                       nonfinite_count=self.nonfinite_streak, seconds=time.perf_counter() - t0, step=self.step,
                       ref_seconds=ref_seconds, train_threads_max=int(threads_max))
        if self.nonfinite_streak >= cfg.max_nonfinite_steps:
            raise RuntimeError(
                f"loss was NaN/inf for {self.nonfinite_streak} consecutive steps at step {self.step}; "
                f"lower learner.lr or check rewards and advantages for NaN/inf (every update was skipped, "
                f"the weights are those of step {self.step - self.nonfinite_streak}); "
                f"the last checkpoint is at {self.last_checkpoint or '(none written by this run)'}")
        return metrics

    def _reference_logps(self, mbs: list[MicroBatch]) -> list[torch.Tensor]:
        """Reference log-probs of this rank's micro-batches, in the training loop: from the frozen copy,
        or under LoRA from the learner's own model with adapters off (the base model, no copy)."""
        with torch.no_grad():
            if self.reference is not None:
                return [self._forward(mb, with_entropy=False, model=self.reference)[0] for mb in mbs]
            with self.engine.module.disable_adapter():
                return [self._forward(mb, with_entropy=False)[0] for mb in mbs]

    def _optimizer_step(self) -> tuple[float, bool]:
        """engine.step() once; returns (grad norm before clipping, whether the update was applied)."""
        if self.cfg.zero_stage == 0:
            # No ZeRO optimizer, so no overflow check in fp32: check the (already averaged) grads here.
            grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
            norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
            if not math.isfinite(norm):
                self.engine.zero_grad()
                return norm, False
            self.engine.step()
            return norm, True
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        return norm, bool(self.engine.was_step_applied())

    def _reduce_metrics(self, sums: dict, passes: int, total_tokens: int) -> dict:
        """Exact batch-level values: loss/pg_loss are sums of per-micro-batch shares (mean over ranks
        = full-batch value); the rest are token-weighted. Averaged over the mu passes run."""
        keys = list(sums)
        reduced = dict(zip(keys, self._all_reduce([sums[k] for k in keys])))
        out = {"loss": reduced["loss"] / self.world_size / passes,
               "pg_loss": reduced["pg_loss"] / self.world_size / passes}
        for name in _TOKEN_MEAN_METRICS:
            out[name] = reduced[name] / max(total_tokens, 1) / passes
        for name in ("entropy", "logprob_diff_mean"):  # measured in the first pass only
            out[name] = reduced[name] / max(total_tokens, 1)
        if self.algo.tis_cap is None and self.algo.behavior_correction == "tis":  # no weights computed
            out.pop("tis_weight_mean")
        return out

    # ------------------------------------------------------------------ #
    # weights: broadcast to the engines, consolidated copies
    # ------------------------------------------------------------------ #
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

    def sequence_logprobs(self, seqs: list[list[int]]) -> list[list[float]]:
        """log p(token t | tokens < t) for t >= 1 of each sequence, from the training model as it is
        (peft adapters on, dropout off). Collective under ZeRO-3 (every rank runs the forward)."""
        module = self.engine.module
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad():
                out = []
                for s in seqs:
                    ids = torch.tensor([s], device=self.device)
                    logits = self.engine(input_ids=ids, use_cache=False).logits[:, :-1].float()
                    out.append(grpo.token_logprobs(logits, ids[:, 1:])[0].tolist())
                return out
        finally:
            module.train(was_training)

    def export_hf(self, out_dir: str) -> None:
        """A plain HF model directory (safetensors + config + tokenizer); rank 0 writes. Collective."""
        sd = self._hf_state_dict()
        adapter = self.adapter_state_dict() if self.cfg.lora else {}
        if self.rank == 0:
            with naming_save_errors(out_dir):
                write_hf_dir(sd, out_dir, self.model_path)
                if self.cfg.lora:  # the adapter too, in peft format (PeftModel.from_pretrained)
                    self._write_adapter(adapter, os.path.join(out_dir, "adapter"))
        self._barrier()

    def _write_adapter(self, tensors: dict, out_dir: str) -> None:
        write_adapter_dir(tensors, adapter_config_json(self.engine.module, self.model_path), out_dir)

    def optimizer_state_bytes(self) -> int:
        """Bytes this rank's optimizer holds (Adam moments, and ZeRO's fp32 master partitions)."""
        opt = self.engine.optimizer
        inner = getattr(opt, "optimizer", opt)  # ZeRO wraps the torch optimizer
        tensors = [t for st in inner.state.values() for t in st.values() if torch.is_tensor(t)]
        tensors += [p for g in inner.param_groups for p in g["params"]]  # what it steps (ZeRO: fp32 partitions)
        return sum(t.numel() * t.element_size() for t in tensors)

    def _barrier(self) -> None:
        import deepspeed.comm as dist
        dist.barrier()

    # ------------------------------------------------------------------ #
    # checkpoints (learner/checkpoint.py holds the formats and the driver's side)
    # ------------------------------------------------------------------ #
    def save_checkpoint(self, path: str, tag: str) -> None:
        """Model, optimizer and LR schedule (DeepSpeed's files) + this rank's RNG and counters (JSON)."""
        with checkpoint.naming_save_errors(path):
            self.engine.save_checkpoint(path, tag=tag, client_state={}, save_latest=False)
            adapter = self.adapter_state_dict() if self.cfg.lora else {}
            if self.rank == 0:  # config + tokenizer, so the checkpoint exports on its own
                checkpoint.write_hf_meta(self.model_path, os.path.join(path, checkpoint.HF_META_DIR))
                if self.cfg.lora:  # the adapter in peft format: export merges it into the base model
                    self._write_adapter(adapter, os.path.join(path, checkpoint.ADAPTER_DIR))
            checkpoint.write_worker_state(path, tag, self.rank, {
                "step": self.step, "nonfinite_streak": self.nonfinite_streak, "rng": checkpoint.rng_state()})
        self.last_checkpoint = checkpoint.final_path(path)  # where the driver's commit will put it
        self._barrier()  # every rank's files are on disk before the driver commits

    def load_checkpoint(self, path: str, tag: str) -> None:
        """Restore what save_checkpoint wrote. Call on fresh workers (ZeRO-3 needs an unpartitioned start)."""
        with checkpoint.safe_torch_load():
            load_path, _ = self.engine.load_checkpoint(path, tag=tag, load_optimizer_states=True,
                                                       load_lr_scheduler_states=True)
        if load_path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint with tag {tag!r} under {path}")
        state = checkpoint.read_worker_state(path, tag, self.rank)
        self.step, self.nonfinite_streak = state["step"], state["nonfinite_streak"]
        checkpoint.set_rng_state(state["rng"])
        self.last_checkpoint = path
        self._barrier()
