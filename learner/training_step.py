"""TrainingStep: a learner rank's optimisation step (train_step) and the forward passes it is made of.

A part of learner/worker.py's LearnerWorker, mixed into its class rather than held by it: the driver
calls `train_step` and `lend_threads` on the rank's Ray handle, and Ray finds an actor's remote methods
on its class. It reads what the rank built (worker.py: the DeepSpeed engine, the device, the configs,
the reference copy) and the thread count (actors/runtime/actor_base.py).

Exact micro-batching. Each rank trains on its contiguous 1/W of the batch, in micro-batches
of cfg.micro_batch_size, with ONE optimizer step per pass over the batch. Each micro-batch
loss is its share of the full-batch loss (policy_loss with the GLOBAL token/sequence counts
divided by W, because DeepSpeed averages gradients over the W ranks), DeepSpeed's own
gradient-accumulation scaling is off (GAS=1, backward(scale_wrt_gas=False)) and the
accumulation boundary is set by hand on the last micro-batch, so the update equals one
full-batch step in plain torch (tests/e2e/test_learner.py checks this to 1e-5):

    loss = sum_mb policy_loss(mb; num_tokens = N_tokens / W, num_seqs = N_seqs / W)
"""
from __future__ import annotations

import math
import time
from typing import Any

import torch

from actors.runtime.threads import use_threads
from learner import grpo
from learner.batch import MicroBatch, TrainBatch
from learner.config import AlgoConfig, LearnerConfig
from learner.forward import completion_logits, logprobs_and_entropy
from learner.sequences import PromptSharingUnsupported

# policy_loss's metrics that are token-weighted means over the whole batch (summed as value * tokens,
# then / tokens, averaged over the mu passes). Entropy and logprob_diff_mean are too, measured on the first pass only.
_TOKEN_MEAN_METRICS = ("clip_frac", "ratio_mean", "kl", "tis_weight_mean")


class TrainingStep:
    """train_step (mu passes over a batch, one optimizer step each), lent threads, log-probs of sequences."""

    # Of the rank (worker.py) and its thread count (ActorBase).
    cfg: LearnerConfig
    algo: AlgoConfig
    engine: Any
    device: torch.device
    rank: int
    world_size: int
    threads: int
    share_prompts: bool
    reference_on_learner: bool
    reference: Any
    _memory: Any
    step: int  # and nonfinite_streak, last_checkpoint: the checkpoint part's (checkpoint_state.py)
    train_calls: int = 0  # train_step calls on this actor (lend_threads names one; not checkpointed)
    _lent: tuple[int, int] = (-1, 0)  # (train call, threads): lend_threads' offer for that call
    _threads_max: int = 0  # the most threads the current train step used

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
