"""GRPO math: log-probs, group advantages, KL estimators, the clipped policy loss.

One file, pure torch, nothing imported from the rest of raygrpo, so the whole
algorithm reads top to bottom. Shapes: N sequences (completions), T tokens
(padded), V vocabulary; a mask [N, T] is 1 on real completion tokens.

Papers behind the knobs:
  GRPO      Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical
            Reasoning in Open Language Models" (arXiv:2402.03300): group-normalised
            advantages, PPO clip, k3 KL penalty to a reference model.
  DAPO      Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System
            at Scale" (arXiv:2503.14476): clip-higher (clip_high > clip_low) and the
            token-level mean ("token-mean").
  Dr. GRPO  Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
            Perspective" (arXiv:2503.20783): no std division ("dr_grpo") and a
            constant length normaliser ("seq-mean-token-sum-norm").
  GSPO      Zheng et al. 2025, "Group Sequence Policy Optimization"
            (arXiv:2507.18071): one length-normalised ratio per sequence.
  RLOO      Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style
            Optimization for Learning from Human Feedback in LLMs" (arXiv:2402.14740).
  KL        Schulman 2020, "Approximating KL Divergence" (k1, k2, k3 estimators).
  TIS       Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
            Off-Policy RL Training": truncated importance sampling between the
            sampler (vLLM) and the trainer's log-probs of the same policy.
  AReaL     Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning
            System for Language Reasoning" (arXiv:2505.24298): the decoupled PPO
            objective, for tokens sampled by older policies (section 6).

A variant of an option (an advantage estimator, a KL estimator, a ratio level, an aggregation)
is one function in its section and one entry in that section's table; learner/config.py
AlgoConfig validates the option's config key against the table's keys.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


def _check_choice(name, value, allowed):
    """`allowed`: a table of options (its keys are the names)."""
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; allowed: {', '.join(map(repr, allowed))}")


# --------------------------------------------------------------------------- #
# 1. Log-probs of the sampled tokens
# --------------------------------------------------------------------------- #
# Rows of logits turned to float32 at a time: up to 2**24 elements (64 MiB), and at least one row.
# A small vocabulary fits a whole micro-batch in one chunk (one op, not one per row); callers with
# a big one pass a row per token ([K, 1, V], learner/sequences.py), which keeps a no-grad pass at
# ~2 chunks of extra memory (measured on an H100: 127 MiB for 8192 positions x 151,936 bf16 logits).
# Under autograd each chunk's float32 copy is kept for the backward pass, so training holds the
# float32 logits of the micro-batch either way; only a recomputing kernel would avoid that.
CHUNK_ELEMENTS = 1 << 24


def _row_chunks(logits):
    """Consecutive row slices of [N, T, V] logits holding at most CHUNK_ELEMENTS elements (>= 1 row)."""
    per_row = max(1, logits.shape[1] * logits.shape[2])
    step = max(1, CHUNK_ELEMENTS // per_row)
    return [logits[i:i + step] for i in range(0, logits.shape[0], step)]


def token_logprobs(logits, ids):
    """log pi(y_t | y_<t) = logits[y_t] - logsumexp(logits), float32.  [N,T,V],[N,T] -> [N,T]

    Computed a chunk of rows at a time, so without autograd the float32 copy of a bf16 logits
    tensor (N*T*V*4 bytes, the largest tensor of the step) never exists all at once.
    """
    if logits.dim() != ids.dim() + 1 or logits.shape[:-1] != ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and ids {tuple(ids.shape)} do not match")
    rows, start = [], 0
    for chunk in _row_chunks(logits):
        z = chunk.float()
        picked = z.gather(-1, ids[start:start + len(chunk)].long().unsqueeze(-1)).squeeze(-1)
        rows.append(picked - torch.logsumexp(z, dim=-1))
        start += len(chunk)
    return torch.cat(rows) if rows else logits.new_zeros(logits.shape[:-1], dtype=torch.float32)


def entropy_from_logits(logits):
    """H_t = -sum_v p_v log p_v = logsumexp(z) - sum_v p_v z_v, float32.  [N,T,V] -> [N,T]"""
    rows = []
    for chunk in _row_chunks(logits):
        z = chunk.float()
        rows.append(torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1))
    return torch.cat(rows) if rows else logits.new_zeros(logits.shape[:-1], dtype=torch.float32)


def masked_mean(x, mask, dim=None):
    """sum(x * mask) / sum(mask) over `dim` (all elements if None); 0 where the mask is empty."""
    mask = mask.to(x.dtype)
    x = x.masked_fill(mask == 0, 0.0)  # padding may hold garbage (inf/nan): never let it in
    if dim is None:
        num, den = (x * mask).sum(), mask.sum()
    else:
        num, den = (x * mask).sum(dim), mask.sum(dim)
    return num / torch.where(den == 0, torch.ones_like(den), den)


# --------------------------------------------------------------------------- #
# 2. Group advantages (one scalar per completion, no value network)
# --------------------------------------------------------------------------- #
# Each estimator maps rewards r [B, G] (a row per prompt) to advantages [B, G].
def grpo_advantages(r, eps):
    """DeepSeekMath:  A_i = (r_i - mean(r)) / (std(r) + eps), std unbiased (Bessel, as TRL and verl do)."""
    return (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True, unbiased=True) + eps)


def dr_grpo_advantages(r, eps):
    """Dr. GRPO:  A_i = r_i - mean(r)   (no std: no difficulty bias)."""
    return r - r.mean(dim=1, keepdim=True)


def rloo_advantages(r, eps):
    """RLOO:  A_i = r_i - mean_{j != i} r_j = G/(G-1) * (r_i - mean(r))."""
    return r - (r.sum(dim=1, keepdim=True) - r) / (r.shape[1] - 1)


ADVANTAGE_ESTIMATORS = {"grpo": grpo_advantages, "dr_grpo": dr_grpo_advantages, "rloo": rloo_advantages}


def group_advantages(rewards, group_size, estimator="grpo", eps=1e-6):
    """Advantage of each of the G completions of a prompt, relative to its group.

    rewards: 1-D, length B*G, prompt-major (the G completions of prompt 0 first); `estimator`
    names one of ADVANTAGE_ESTIMATORS above. A group whose rewards are all equal carries no
    learning signal: its advantages are exactly 0 (not rounding noise divided by eps).
    NaN marks an unscorable sample (a reward function returned null): its group is its other,
    scorable samples (the estimator runs on those alone) and its own advantage is 0; a group
    with fewer than 2 scorable samples has no baseline (all 0).
    """
    _check_choice("advantage estimator", estimator, ADVANTAGE_ESTIMATORS)
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (a group needs a baseline), got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards must be 1-D with a length that is a multiple of group_size={group_size}, "
            f"got shape {tuple(rewards.shape)}")
    r = rewards if rewards.is_floating_point() else rewards.float()
    r = r.view(-1, group_size)                                   # [B, G]
    adv = ADVANTAGE_ESTIMATORS[estimator](r, eps)
    constant = (r == r[:, :1]).all(dim=1, keepdim=True)
    adv = adv.masked_fill(constant, 0.0)
    unscorable = torch.isnan(r)
    for b in unscorable.any(dim=1).nonzero().flatten().tolist():  # (rows are independent: the others are untouched)
        ok = ~unscorable[b]
        adv[b] = 0.0
        if ok.sum() >= 2:
            adv[b, ok] = group_advantages(r[b, ok], int(ok.sum()), estimator, eps)
    return adv.reshape(rewards.shape)


# --------------------------------------------------------------------------- #
# 3. KL(pi || pi_ref) per token, from tokens sampled from pi
# --------------------------------------------------------------------------- #
# Schulman's estimators, of d = log pi_ref(y) - log pi(y).
def kl_k1(d):
    """k1 = -d                 unbiased, high variance, can be negative"""
    return -d


def kl_k2(d):
    """k2 = d^2 / 2            biased, low variance, >= 0"""
    return 0.5 * d * d


def kl_k3(d):
    """k3 = exp(d) - d - 1     unbiased, low variance, >= 0  (DeepSeekMath's choice)"""
    return torch.expm1(d) - d  # exp(d) - 1 - d, accurate near d = 0


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_penalty(logp, ref_logp, estimator="k3"):
    """KL(pi || pi_ref) per token with one of KL_ESTIMATORS above."""
    _check_choice("kl estimator", estimator, KL_ESTIMATORS)
    return KL_ESTIMATORS[estimator](ref_logp - logp)


# --------------------------------------------------------------------------- #
# 4. The importance ratio pi_theta / pi_old, per token
# --------------------------------------------------------------------------- #
# Each level maps the (padding-zeroed) log-probs lp, old [N,T] and the mask m to ratios [N,T].
def token_ratio(lp, old, m):
    """PPO/GRPO:  r_t = exp(logp_t - old_logp_t)"""
    return torch.exp(lp - old)


def sequence_ratio(lp, old, m):
    """GSPO:  s = exp( (1/|y|) sum_t (logp_t - old_logp_t) ), applied to every token in the
    GSPO-token form r_t = sg[s] * exp(logp_t - sg[logp_t]) (value s, d r_t / d logp_t = s).
    Use small clips (GSPO: 3e-4 / 4e-4)."""
    seq_log_ratio = masked_mean(lp - old, m, dim=-1)                      # [N]
    return torch.exp(seq_log_ratio.detach().unsqueeze(-1) + lp - lp.detach())


RATIO_LEVELS = {"token": token_ratio, "sequence": sequence_ratio}


# --------------------------------------------------------------------------- #
# 5. Aggregation of the per-token losses l over the mask m
# --------------------------------------------------------------------------- #
@dataclass
class LossInputs:
    """What one (micro-)batch's loss is computed from: its tensors, and the counts of the whole batch.

    logp      [N,T]  log pi_theta(y_t), with grad (the policy being trained)
    old_logp  [N,T]  log pi_old(y_t), the trainer's log-probs of the policy that sampled
    advantages [N]   one per sequence, broadcast over its tokens (or [N,T])
    mask      [N,T]  1 on completion tokens (bool or float); padding values are ignored
    ref_logp  [N,T]  reference model (needed when beta != 0)
    behavior_logp [N,T]  the sampler's (vLLM's) log-probs, for TIS

    Micro-batching: num_tokens (the whole batch's count of masked tokens, for token-mean) and
    num_seqs (the whole batch's N, for the seq-* forms) make each micro-batch loss its share of
    the full-batch loss, so the sum of the micro-batch losses (and of their gradients) equals
    the full-batch ones. None = this batch's own counts. (Data-parallel ranks that average their
    gradients, as DeepSpeed does, pass the global counts divided by the world size.)
    norm_length: Dr. GRPO's constant length normaliser (seq-mean-token-sum-norm).
    """

    logp: torch.Tensor
    old_logp: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    ref_logp: torch.Tensor | None = None
    behavior_logp: torch.Tensor | None = None
    num_tokens: float | None = None
    num_seqs: float | None = None
    norm_length: float | None = None

    def sequences(self) -> float:
        """N for the seq-* aggregations: the whole batch's, or this batch's own."""
        return self.logp.shape[0] if self.num_seqs is None else self.num_seqs


# Each aggregation maps x = m * l [N,T] (zero on padding), m and the inputs to the loss.
def token_mean(x, m, inputs):
    """DAPO:  sum_{i,t} m l / sum_{i,t} m"""
    den = m.sum() if inputs.num_tokens is None else torch.as_tensor(inputs.num_tokens).to(x)
    return x.sum() / torch.where(den == 0, torch.ones_like(den), den)


def seq_mean_token_mean(x, m, inputs):
    """GRPO:  (1/N) sum_i [ sum_t m l / sum_t m ]"""
    return masked_mean(x, m, dim=-1).sum() / max(inputs.sequences(), 1)


def seq_mean_token_sum_norm(x, m, inputs):
    """Dr. GRPO:  sum_{i,t} m l / (N * norm_length)"""
    if inputs.norm_length is None or inputs.norm_length <= 0:
        raise ValueError(f"aggregation 'seq-mean-token-sum-norm' needs norm_length > 0, got {inputs.norm_length!r}")
    return x.sum() / (max(inputs.sequences(), 1) * inputs.norm_length)


AGGREGATIONS = {"token-mean": token_mean, "seq-mean-token-mean": seq_mean_token_mean,
                "seq-mean-token-sum-norm": seq_mean_token_sum_norm}


# --------------------------------------------------------------------------- #
# 6. Off-policy correction: the weight of each token's loss, from the log-probs of the
#    proximal policy (old, the trainer's before this update) and of the behaviour policy
#    (behav, the sampler's, vLLM's: per token, whatever version sampled it)
# --------------------------------------------------------------------------- #
# Each maps (old, behav, cap) [N,T] to detached weights [N,T]; cap may be None (no cap).
def tis_weights(old, behav, cap):
    """TIS:  w_t = sg[min(pi_old(y_t) / pi_behav(y_t), cap)]   (truncated: large ratios are cut to cap)"""
    return torch.clamp(torch.exp(old - behav), max=cap).detach()


def decoupled_weights(old, behav, cap):
    """AReaL's decoupled PPO objective (Fu et al. 2025, eq. 5), with the proximal policy pi_prox = pi_old:

        J(theta) = E[ sum_t  pi_prox(y_t) / pi_behav(y_t) * min(u_t A, clip(u_t, 1 - eps, 1 + eps) A) ],
        u_t = pi_theta(y_t) / pi_prox(y_t)

    The clip trusts the region around the proximal policy (the trainer's weights now), not around the
    stale one that sampled; the behaviour ratio reweights each token to it. As in AReaL, a token whose
    ratio exceeds `cap` is left out (weight 0) rather than truncated: w_t = sg[r_t * 1(r_t <= cap)]."""
    w = torch.exp(old - behav)
    if cap is not None:
        w = torch.where(w <= cap, w, torch.zeros_like(w))
    return w.detach()


def no_correction(old, behav, cap):
    """No correction:  w_t = 1   (the sampler's log-probs are not read: a token sampled by an older policy is
    trained as if the trainer's own policy had sampled it, the ratio taken against old_logp alone).
    The "off" that TIS and the decoupled objective are measured against (docs/STATUS.md, pipeline mode)."""
    return torch.ones_like(old)


BEHAVIOR_CORRECTIONS = {"tis": tis_weights, "decoupled": decoupled_weights, "none": no_correction}


# --------------------------------------------------------------------------- #
# 7. The policy loss
# --------------------------------------------------------------------------- #
class LossSettings(Protocol):
    """The knobs policy_loss reads (learner/config.py AlgoConfig is one; each defaults there)."""

    clip_low: float  # PPO clip below 1
    clip_high: float  # above 1; > clip_low is DAPO's clip-higher
    ratio_level: str  # a key of RATIO_LEVELS
    aggregation: str  # a key of AGGREGATIONS
    beta: float  # the KL term's coefficient
    kl_estimator: str  # a key of KL_ESTIMATORS
    tis_cap: float | None  # TIS weights' cap; None: no TIS (decoupled: no cap; none: not read)
    behavior_correction: str  # a key of BEHAVIOR_CORRECTIONS


def policy_loss(inputs: LossInputs, algo: LossSettings):
    """Clipped surrogate loss of GRPO and its variants. Returns (loss, metrics).

    Per-token loss, with the ratio r_t of algo.ratio_level (section 4):
      l_t = -min(r_t A, clip(r_t, 1 - clip_low, 1 + clip_high) A) * w_t + beta * KL_t
      clip_high > clip_low is DAPO's clip-higher; KL_t = kl_penalty(logp, ref_logp) (section 3).
      w_t: the off-policy weight of algo.behavior_correction (section 6) when behavior_logp is given:
      "tis" sg[min(exp(old_logp_t - behavior_logp_t), tis_cap)] (only with a tis_cap), "decoupled"
      (AReaL) the same ratio, tokens above tis_cap left out, "none" 1; else 1.
    The loss: the per-token losses aggregated over the mask by algo.aggregation (section 5).
    Metrics are means over this batch. An all-zero mask gives loss 0 (with a grad graph), never NaN.
    """
    logp, old_logp, advantages, mask = inputs.logp, inputs.old_logp, inputs.advantages, inputs.mask
    ref_logp, behavior_logp = inputs.ref_logp, inputs.behavior_logp
    _check_choice("ratio_level", algo.ratio_level, RATIO_LEVELS)
    _check_choice("aggregation", algo.aggregation, AGGREGATIONS)
    _check_choice("kl estimator", algo.kl_estimator, KL_ESTIMATORS)
    _check_choice("behavior_correction", algo.behavior_correction, BEHAVIOR_CORRECTIONS)
    if algo.beta != 0.0 and ref_logp is None:
        raise ValueError(f"beta={algo.beta} needs ref_logp")
    if algo.clip_low < 0 or algo.clip_high < 0:
        raise ValueError(f"clip_low and clip_high must be >= 0, got {algo.clip_low}, {algo.clip_high}")
    if old_logp.shape != logp.shape or mask.shape != logp.shape or logp.dim() != 2:
        raise ValueError(f"logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)} and "
                         f"mask {tuple(mask.shape)} must all be [N, T]")
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"advantages must be [N] or [N, T], got {tuple(advantages.shape)}")

    pad = mask == 0
    m = mask.to(logp.dtype)
    lp = logp.masked_fill(pad, 0.0)        # zero the padding first: garbage there (even
    old = old_logp.masked_fill(pad, 0.0)   # inf/nan) never reaches the loss or its grad
    adv = advantages.to(logp.dtype)
    adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv.masked_fill(pad, 0.0)

    # 7a. importance ratio pi_theta / pi_old
    ratio = RATIO_LEVELS[algo.ratio_level](lp, old, m)

    # 7b. clipped surrogate (PPO), pessimistic of the two branches
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - algo.clip_low, 1.0 + algo.clip_high)
    pg = torch.maximum(unclipped, clipped)

    # 7c. off-policy correction (section 6): sampler != trainer numerics, and older policy versions
    tis = behavior_logp is not None and (algo.tis_cap is not None or algo.behavior_correction != "tis")
    if tis:
        beh = behavior_logp.masked_fill(pad, 0.0)
        tis_w = BEHAVIOR_CORRECTIONS[algo.behavior_correction](old, beh, algo.tis_cap)
        pg = pg * tis_w

    # 7d. KL penalty to the reference policy
    per_token = pg
    if ref_logp is not None:
        kl = kl_penalty(lp, ref_logp.masked_fill(pad, 0.0), algo.kl_estimator)
        if algo.beta != 0.0:
            per_token = pg + algo.beta * kl

    # 7e. aggregate
    combine = AGGREGATIONS[algo.aggregation]

    def aggregate(x):
        return combine(x.masked_fill(pad, 0.0) * m, m, inputs)

    loss = aggregate(per_token)

    with torch.no_grad():
        metrics = {
            "pg_loss": aggregate(pg).item(),
            "clip_frac": masked_mean((clipped > unclipped).to(m), m).item(),
            "ratio_mean": masked_mean(ratio, m).item(),
        }
        if ref_logp is not None:
            metrics["kl"] = masked_mean(kl, m).item()
        if tis:
            metrics["tis_weight_mean"] = masked_mean(tis_w, m).item()
    return loss, metrics
