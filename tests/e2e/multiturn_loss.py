"""Helpers for tests/e2e/test_multiturn.py (no tests here): the learner's loss and gradients on a
TrainBatch, computed by the learner's own code, and an independent one over model tokens only."""
from __future__ import annotations

import torch

from learner import grpo
from learner.batch import TrainBatch
from learner.config import AlgoConfig
from learner.forward import completion_logits, logprobs_and_entropy

ALGO = AlgoConfig(beta=0.1, tis_cap=2.0)  # KL and TIS on: every per-token input takes part


def _model(model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.config.use_cache = False
    return model


def _grads(model) -> dict:
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def learner_loss_and_grads(model_dir, batch: TrainBatch):
    """One micro-batch through the learner's forward (learner/forward.py, prompts shared as in
    training) and grpo.policy_loss with the arguments LearnerWorker.train_step passes (mu=1:
    old = logp.detach()); a plain model stands in for the DeepSpeed engine."""
    model = _model(model_dir)
    mb = batch.micro_batches(len(batch), by_length=True, share_prompts=True)[0]
    logp, _ = logprobs_and_entropy(*completion_logits(model, mb, torch.device("cpu"), share_prompts=True),
                                   with_entropy=False)
    loss, _ = grpo.policy_loss(grpo.LossInputs(
        logp, logp.detach(), mb.advantages, mb.mask, ref_logp=mb.ref_logp, behavior_logp=mb.behavior_logp,
        num_tokens=batch.num_completion_tokens(), num_seqs=len(batch), norm_length=batch.norm_length()), ALGO)
    loss.backward()
    return float(loss.detach()), _grads(model)


def model_tokens_only_loss_and_grads(model_dir, batch: TrainBatch):
    """Each sequence run alone; log-probs taken at the model's positions only, packed left, so the
    loss never sees an environment position (only right padding, masked as usual)."""
    model = _model(model_dir)
    rows, beh, ref = [], [], []
    for i, (p, c) in enumerate(zip(batch.prompt_ids, batch.completion_ids)):
        ids = torch.tensor([p + c])
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[0, 1:, None])[:, 0][len(p) - 1:]
        keep = [j for j, m in enumerate(batch.loss_mask[i]) if m]
        rows.append(lp[keep])
        beh.append(torch.tensor([batch.behavior_logp[i][j] for j in keep]))
        ref.append(torch.tensor([batch.ref_logp[i][j] for j in keep]))
    width = max(len(r) for r in rows)

    def pad(xs):
        return torch.stack([torch.nn.functional.pad(x, (0, width - len(x))) for x in xs])

    logp = pad(rows)
    mask = pad([torch.ones(len(r)) for r in rows])
    loss, _ = grpo.policy_loss(grpo.LossInputs(
        logp, logp.detach(), torch.tensor(batch.advantages), mask, ref_logp=pad(ref), behavior_logp=pad(beh)), ALGO)
    loss.backward()
    return float(loss.detach()), _grads(model)
