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
"""
import torch

ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
KL_ESTIMATORS = ("k1", "k2", "k3")
RATIO_LEVELS = ("token", "sequence")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _check_choice(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; allowed: {', '.join(map(repr, allowed))}")


# --------------------------------------------------------------------------- #
# 1. Log-probs of the sampled tokens
# --------------------------------------------------------------------------- #
# Rows of logits turned to float32 at a time: up to 2**24 elements (64 MiB), and at least one row.
# A small vocabulary fits a whole micro-batch in one chunk (one op, not one per row); callers with
# a big one pass a row per token ([K, 1, V], actors/runtime/sequences.py), which keeps a no-grad pass at
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
def group_advantages(rewards, group_size, estimator="grpo", eps=1e-6):
    """Advantage of each of the G completions of a prompt, relative to its group.

    rewards: 1-D, length B*G, prompt-major (the G completions of prompt 0 first).
      grpo     (DeepSeekMath):  A_i = (r_i - mean(r)) / (std(r) + eps), std unbiased
                                (Bessel, as TRL and verl do).
      dr_grpo  (Dr. GRPO):      A_i = r_i - mean(r)      (no std: no difficulty bias)
      rloo     (RLOO):          A_i = r_i - mean_{j != i} r_j = G/(G-1) * (r_i - mean(r))
    A group whose rewards are all equal carries no learning signal: its
    advantages are exactly 0 (not rounding noise divided by eps).
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
    mean = r.mean(dim=1, keepdim=True)
    if estimator == "grpo":
        adv = (r - mean) / (r.std(dim=1, keepdim=True, unbiased=True) + eps)
    elif estimator == "dr_grpo":
        adv = r - mean
    else:  # rloo
        adv = r - (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
    constant = (r == r[:, :1]).all(dim=1, keepdim=True)
    adv = adv.masked_fill(constant, 0.0)
    return adv.reshape(rewards.shape)


# --------------------------------------------------------------------------- #
# 3. KL(pi || pi_ref) per token, from tokens sampled from pi
# --------------------------------------------------------------------------- #
def kl_penalty(logp, ref_logp, estimator="k3"):
    """Schulman's estimators of KL(pi || pi_ref), with d = log pi_ref(y) - log pi(y):
      k1 = -d                     unbiased, high variance, can be negative
      k2 = d^2 / 2                biased, low variance, >= 0
      k3 = exp(d) - d - 1         unbiased, low variance, >= 0  (DeepSeekMath's choice)
    """
    _check_choice("kl estimator", estimator, KL_ESTIMATORS)
    d = ref_logp - logp
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    return torch.expm1(d) - d  # exp(d) - 1 - d, accurate near d = 0


# --------------------------------------------------------------------------- #
# 4. The policy loss
# --------------------------------------------------------------------------- #
def policy_loss(logp, old_logp, advantages, mask, *, clip_low=0.2, clip_high=0.2,
                ratio_level="token", aggregation="token-mean", ref_logp=None, beta=0.0,
                kl_estimator="k3", behavior_logp=None, tis_cap=None, norm_length=None,
                num_tokens=None, num_seqs=None):
    """Clipped surrogate loss of GRPO and its variants. Returns (loss, metrics).

    logp      [N,T]  log pi_theta(y_t), with grad (the policy being trained)
    old_logp  [N,T]  log pi_old(y_t), the trainer's log-probs of the policy that sampled
    advantages [N]   one per sequence, broadcast over its tokens
    mask      [N,T]  1 on completion tokens (bool or float); padding values are ignored
    ref_logp  [N,T]  reference model (needed when beta != 0)
    behavior_logp [N,T]  the sampler's (vLLM's) log-probs, for TIS

    Ratio (ratio_level):
      token     (PPO/GRPO):  r_t = exp(logp_t - old_logp_t)
      sequence  (GSPO):      s = exp( (1/|y|) sum_t (logp_t - old_logp_t) ), applied to
                every token in the GSPO-token form r_t = sg[s] * exp(logp_t - sg[logp_t])
                (value s, d r_t / d logp_t = s). Use small clips (GSPO: 3e-4 / 4e-4).
    Per-token loss:
      l_t = -min(r_t A, clip(r_t, 1 - clip_low, 1 + clip_high) A) * w_t + beta * KL_t
      clip_high > clip_low is DAPO's clip-higher; KL_t = kl_penalty(logp, ref_logp).
      w_t = sg[min(exp(old_logp_t - behavior_logp_t), tis_cap)] (TIS) when both
      behavior_logp and tis_cap are given, else 1.
    Aggregation over the mask m:
      token-mean               (DAPO):     sum_{i,t} m l / sum_{i,t} m
      seq-mean-token-mean      (GRPO):     (1/N) sum_i [ sum_t m l / sum_t m ]
      seq-mean-token-sum-norm  (Dr. GRPO): sum_{i,t} m l / (N * norm_length)

    Micro-batching: pass num_tokens (the whole batch's count of masked tokens,
    for token-mean) and num_seqs (the whole batch's N, for the seq-* forms).
    Each micro-batch loss is then its share of the full-batch loss, and the sum
    of the micro-batch losses (and of their gradients) equals the full-batch
    ones. None = this batch's own counts. Metrics are means over this batch.
    (Data-parallel ranks that average their gradients, as DeepSpeed does, should
    pass the global counts divided by the world size.)
    An all-zero mask gives loss 0 (with a grad graph), never NaN.
    """
    _check_choice("ratio_level", ratio_level, RATIO_LEVELS)
    _check_choice("aggregation", aggregation, AGGREGATIONS)
    _check_choice("kl estimator", kl_estimator, KL_ESTIMATORS)
    if aggregation == "seq-mean-token-sum-norm" and (norm_length is None or norm_length <= 0):
        raise ValueError(f"aggregation 'seq-mean-token-sum-norm' needs norm_length > 0, got {norm_length!r}")
    if beta != 0.0 and ref_logp is None:
        raise ValueError(f"beta={beta} needs ref_logp")
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low and clip_high must be >= 0, got {clip_low}, {clip_high}")
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

    # 4a. importance ratio pi_theta / pi_old
    if ratio_level == "token":
        ratio = torch.exp(lp - old)
    else:
        seq_log_ratio = masked_mean(lp - old, m, dim=-1)                      # [N]
        ratio = torch.exp(seq_log_ratio.detach().unsqueeze(-1) + lp - lp.detach())

    # 4b. clipped surrogate (PPO), pessimistic of the two branches
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(unclipped, clipped)

    # 4c. truncated importance sampling: correct for sampler != trainer numerics
    tis = behavior_logp is not None and tis_cap is not None
    if tis:
        beh = behavior_logp.masked_fill(pad, 0.0)
        tis_w = torch.clamp(torch.exp(old - beh), max=tis_cap).detach()
        pg = pg * tis_w

    # 4d. KL penalty to the reference policy
    per_token = pg
    if ref_logp is not None:
        kl = kl_penalty(lp, ref_logp.masked_fill(pad, 0.0), kl_estimator)
        if beta != 0.0:
            per_token = pg + beta * kl

    # 4e. aggregate
    def aggregate(x):
        x = x.masked_fill(pad, 0.0) * m
        n = x.shape[0] if num_seqs is None else num_seqs
        if aggregation == "token-mean":
            den = m.sum() if num_tokens is None else torch.as_tensor(num_tokens).to(x)
            return x.sum() / torch.where(den == 0, torch.ones_like(den), den)
        if aggregation == "seq-mean-token-mean":
            return masked_mean(x, m, dim=-1).sum() / max(n, 1)
        return x.sum() / (max(n, 1) * norm_length)

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
