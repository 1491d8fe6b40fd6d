"""Helpers shared by the learner e2e tests (no tests here): start DeepSpeed ranks as Ray actors,
a deterministic batch, and an independent single-process plain-torch reference of a GRPO step."""
from __future__ import annotations

import random

import torch
import torch.distributed as dist

from actors.runtime.sockets import free_port
from cluster.launch.placement import learner_port_key
from learner import grpo
from learner.batch import TrainBatch
from learner.config import AlgoConfig, LearnerConfig
from learner.worker import LearnerWorker


def start_ranks(ray, model_dir, cfg: LearnerConfig, algo: AlgoConfig, *, total_steps=10, seed=0, lendable=False):
    """cfg.num_ranks LearnerWorker actors that form one DeepSpeed group (constructor finished).
    `lendable`: with the "lend" concurrency group, as cluster/launch/placement.py starts them in async on CPU."""
    actor = ray.remote(num_cpus=0.5, **({"concurrency_groups": {"lend": 1}} if lendable else {}))(LearnerWorker)
    # As a run does: rank 0 binds a port of its own and posts it (a port picked here was taken in between once)
    key = learner_port_key()
    ranks = [actor.remote(str(model_dir), cfg, algo, rank=r, world_size=cfg.num_ranks, master_addr="127.0.0.1",
                          master_port=0, port_key=key, total_steps=total_steps, seed=seed) for r in range(cfg.num_ranks)]
    # Bounded: one run of the whole suite (session 19) waited here over 15 minutes on a rank that had finished
    # its constructor, and pytest-timeout's alarm never reached the blocked ray.get; a named failure instead.
    ready, _ = ray.wait([w.info.remote() for w in ranks], num_returns=len(ranks), timeout=300)
    if len(ready) < len(ranks):
        raise TimeoutError(f"{len(ranks) - len(ready)} of {len(ranks)} learner ranks did not answer info() in 300 s")
    ray.get(ready)  # a constructor's error, raised here
    return ranks


def on_all(ray, ranks, method, *args):
    """Call `method` on every rank (they meet in collectives) and return rank 0's result."""
    return ray.get([getattr(w, method).remote(*args) for w in ranks])[0]


def stop(ray, ranks):
    for w in ranks:
        ray.kill(w)


def make_batch(n=6, seed=0, vocab=60, with_ref=False, group_size=1) -> TrainBatch:
    """n sequences of different prompt/completion lengths, random advantages, plausible log-probs;
    each prompt `group_size` times in a row (a GRPO group: the learner then shares its forward pass)."""
    g = random.Random(seed)
    prompts = [[g.randrange(3, vocab) for _ in range(g.randrange(2, 7))] for _ in range(n // group_size)]
    prompts = [p for p in prompts for _ in range(group_size)]
    comps = [[g.randrange(3, vocab) for _ in range(g.randrange(1, 9))] for _ in range(n)]
    return TrainBatch(
        prompt_ids=prompts, completion_ids=comps, advantages=[g.gauss(0, 1) for _ in range(n)],
        behavior_logp=[[-4.3 + g.uniform(-0.3, 0.3) for _ in c] for c in comps],
        ref_logp=[[-4.3 + g.uniform(-0.3, 0.3) for _ in c] for c in comps] if with_ref else None, pad_id=0)


def _seq_logprobs(model, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, C] completion log-probs, each sequence run ALONE (no padding), and the mask."""
    n, C = len(batch), max(len(c) for c in batch.completion_ids)
    rows = []
    for p, c in zip(batch.prompt_ids, batch.completion_ids):
        ids = torch.tensor([p + c])
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[0, 1:, None])[:, 0][len(p) - 1:]
        rows.append(torch.nn.functional.pad(lp, (0, C - len(c))))
    mask = torch.zeros(n, C)
    for i, c in enumerate(batch.completion_ids):
        mask[i, : len(c)] = 1
    return torch.stack(rows), mask


def _padded(rows, C):
    return torch.tensor([r + [0.0] * (C - len(r)) for r in rows])


def reference_step(model_dir, batch: TrainBatch, cfg: LearnerConfig, algo: AlgoConfig, model=None, opt=None):
    """One learner step (mu passes) in plain torch on one process, full batch. Returns (losses, model, opt)."""
    from transformers import AutoModelForCausalLM

    if model is None:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        model.config.use_cache = False
        model.train()
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    C = max(len(c) for c in batch.completion_ids)
    beh = _padded(batch.behavior_logp, C)
    ref = None if batch.ref_logp is None else _padded(batch.ref_logp, C)
    adv = torch.tensor(batch.advantages)
    old = None
    if cfg.mu > 1:
        with torch.no_grad():
            old, _ = _seq_logprobs(model, batch)
    losses = []
    for _ in range(cfg.mu):
        logp, mask = _seq_logprobs(model, batch)
        loss, _ = grpo.policy_loss(grpo.LossInputs(
            logp, logp.detach() if old is None else old, adv, mask, ref_logp=ref, behavior_logp=beh), algo)
        opt.zero_grad()
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
    return losses, model, opt


def max_weight_diff(sd: dict, model) -> float:
    ref = dict(model.named_parameters())
    assert set(sd) == set(ref), (sorted(set(sd) ^ set(ref)))
    return max((sd[k] - ref[k].detach()).abs().max().item() for k in sd)


def in_process_rank(model_dir, cfg: LearnerConfig, algo: AlgoConfig, reference_on_learner=False) -> LearnerWorker:
    """One learner rank in this process, alone in its world (no Ray): the GPU tests run where Ray cannot."""
    return LearnerWorker(str(model_dir), cfg, algo, rank=0, world_size=1, master_addr="127.0.0.1",
                         master_port=free_port(), total_steps=10, seed=0, reference_on_learner=reference_on_learner)


def whole_weights(rank: LearnerWorker) -> dict[str, torch.Tensor]:
    """The rank's whole weights as float32 on CPU: ZeRO-0/1/2 keep them whole on one rank. (Not
    full_state_dict: it goes through learner/weight_sync.py, which needs vLLM.)"""
    return {k: v.detach().float().cpu() for k, v in rank.engine.module.named_parameters()}


def drop_deepspeed_groups() -> None:
    """After an in-process rank: the product runs one rank per process; these tests start ranks in turn in
    one process, so DeepSpeed's cached groups of the first (deepspeed.utils.groups) must go with its
    process group, or the next deepspeed.initialize asks a destroyed group for its rank."""
    from deepspeed.utils import groups

    if dist.is_initialized():
        dist.destroy_process_group()
    for name in ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP",
                 "_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP"):
        setattr(groups, name, None)
    for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                 "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP"):
        setattr(groups, name, {})
