"""Unit tests of learner/grpo.py: hand-computed values, gradients, properties."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import learner.grpo as grpo
from learner.config import AlgoConfig
from learner.grpo import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATIONS,
    BEHAVIOR_CORRECTIONS,
    KL_ESTIMATORS,
    RATIO_LEVELS,
    LossInputs,
    entropy_from_logits,
    group_advantages,
    kl_penalty,
    masked_mean,
    policy_loss,
    token_logprobs,
)

FAST = settings(max_examples=50, deadline=None)
AGGS = list(AGGREGATIONS)


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


def loss_of(logp, old_logp, advantages, mask, *, ref_logp=None, behavior_logp=None, num_tokens=None, num_seqs=None,
            norm_length=None, **knobs):
    """policy_loss of these tensors and counts, with the knobs of AlgoConfig (TIS off unless tis_cap is given)."""
    inputs = LossInputs(logp, old_logp, advantages, mask, ref_logp=ref_logp, behavior_logp=behavior_logp,
                        num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)
    return policy_loss(inputs, AlgoConfig(**{"tis_cap": None, **knobs}))


def close(a, b, atol=1e-5):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float64),
                          torch.as_tensor(b, dtype=torch.float64), atol=atol, rtol=1e-5)


# --------------------------------------------------------------------------- hand values
def test_token_logprobs_and_entropy_hand_values():
    # logits [0, ln 3]: p = [1/4, 3/4]
    logits = t([[[0.0, math.log(3.0)], [0.0, 0.0]]])
    ids = torch.tensor([[0, 1]])
    assert close(token_logprobs(logits, ids), [[math.log(0.25), math.log(0.5)]])
    # H([1/4,3/4]) = 0.25 ln 4 + 0.75 ln(4/3) = 0.562335; H(uniform 2) = ln 2 = 0.693147
    assert close(entropy_from_logits(logits), [[0.562335, 0.693147]])


def test_token_logprobs_of_no_rows():
    empty = torch.zeros(0, 1, 5)
    assert token_logprobs(empty, torch.zeros(0, 1, dtype=torch.long)).shape == (0, 1)
    assert entropy_from_logits(empty).shape == (0, 1)


def test_token_logprobs_bf16_returns_float32():
    logits = torch.randn(2, 3, 7).to(torch.bfloat16)
    ids = torch.randint(0, 7, (2, 3))
    out = token_logprobs(logits, ids)
    assert out.dtype == torch.float32 and out.shape == (2, 3)


def test_masked_mean_hand_values():
    x = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = t([[1, 0, 1], [0, 0, 0]])
    assert close(masked_mean(x, mask), 2.0)
    assert close(masked_mean(x, mask, dim=-1), [2.0, 0.0])
    assert close(masked_mean(x, torch.zeros(2, 3)), 0.0)


def test_grpo_advantages_hand_values():
    # group [1,0,0,1]: mean .5, unbiased std sqrt(1/3)=0.577350 -> +-0.866025 (eps 1e-6 ~ 1.5e-6 off)
    # group [1,3]: mean 2, unbiased std sqrt(2) -> -+0.707107
    adv = group_advantages(t([1.0, 0.0, 0.0, 1.0]), 4)
    assert close(adv, [0.866024, -0.866024, -0.866024, 0.866024])
    adv = group_advantages(t([1.0, 3.0, 5.0, 5.0]), 2)
    assert close(adv, [-0.707106, 0.707106, 0.0, 0.0])


def test_dr_grpo_advantages_hand_values():
    adv = group_advantages(t([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 3.0, 1.0]), 4, "dr_grpo")
    assert close(adv, [0.5, -0.5, -0.5, 0.5, -1.0, -1.0, 2.0, 0.0])


def test_rloo_advantages_hand_values():
    # [1,0,0,1]: 1 - 1/3, 0 - 2/3; [0,0,3]: 0 - 1.5, 3 - 0
    adv = group_advantages(t([1.0, 0.0, 0.0, 1.0]), 4, "rloo")
    assert close(adv, [2 / 3, -2 / 3, -2 / 3, 2 / 3])
    adv = group_advantages(t([0.0, 0.0, 3.0]), 3, "rloo")
    assert close(adv, [-1.5, -1.5, 3.0])


def test_integer_rewards_accepted():
    adv = group_advantages(torch.tensor([1, 0, 0, 0]), 2, "dr_grpo")
    assert adv.dtype.is_floating_point and close(adv, [0.5, -0.5, 0.0, 0.0])


def test_kl_estimators_hand_values():
    logp = t([-1.0, -2.0, -3.0])
    ref = t([-2.0, -1.0, -3.0])          # d = ref - logp = [-1, 1, 0]
    assert close(kl_penalty(logp, ref, "k1"), [1.0, -1.0, 0.0])
    assert close(kl_penalty(logp, ref, "k2"), [0.5, 0.5, 0.0])
    # k3: e^-1 + 1 - 1 = 0.367879; e - 1 - 1 = 0.718282
    assert close(kl_penalty(logp, ref, "k3"), [0.367879, 0.718282, 0.0])
    assert close(kl_penalty(logp, ref), [0.367879, 0.718282, 0.0])


def _two_seq_batch():
    # r = 1 everywhere, beta 0: per-token loss = -A; row 0 -> -1 x3, row 1 -> +2 x1
    logp = t([[-1.0, -2.0, -0.5], [-1.5, -9.0, -9.0]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    return logp, logp.clone(), t([1.0, -2.0]), mask


@pytest.mark.parametrize("aggregation,norm_length,expected", [
    ("token-mean", None, -0.25),              # (-3 + 2) / 4
    ("seq-mean-token-mean", None, 0.5),       # (-1 + 2) / 2
    ("seq-mean-token-sum-norm", 4, -0.125),   # (-3 + 2) / (2 * 4)
])
def test_aggregations_hand_values(aggregation, norm_length, expected):
    logp, old, adv, mask = _two_seq_batch()
    loss, metrics = loss_of(logp, old, adv, mask, aggregation=aggregation, norm_length=norm_length)
    assert close(loss, expected)
    assert close(metrics["pg_loss"], expected)
    assert metrics["clip_frac"] == 0.0 and close(metrics["ratio_mean"], 1.0)
    bool_loss, _ = loss_of(logp, old, adv, mask.bool(), aggregation=aggregation, norm_length=norm_length)
    assert close(bool_loss, expected)


def test_clipping_hand_values():
    # four single-token sequences: (r, A) = (1.5, 1), (1.5, -1), (0.5, -1), (0.5, 1)
    # per-token loss: -min(1.5, 1.2) = -1.2 [clipped]; -min(-1.5, -1.2) = 1.5;
    #                 -min(-0.5, -0.8) = 0.8 [clipped]; -min(0.5, 0.8) = -0.5
    old = t([[-1.0], [-1.0], [-1.0], [-1.0]])
    logp = old + t([[math.log(1.5)], [math.log(1.5)], [math.log(0.5)], [math.log(0.5)]])
    adv = t([1.0, -1.0, -1.0, 1.0])
    loss, metrics = loss_of(logp, old, adv, torch.ones(4, 1))
    assert close(loss, (-1.2 + 1.5 + 0.8 - 0.5) / 4)   # 0.15
    assert close(metrics["clip_frac"], 0.5)
    assert close(metrics["ratio_mean"], 1.0)
    # DAPO clip-higher: upper bound 1.28 for the first token -> -1.28
    loss, _ = loss_of(logp[:1], old[:1], adv[:1], torch.ones(1, 1), clip_high=0.28)
    assert close(loss, -1.28)


def test_kl_term_in_loss_hand_values():
    logp = t([[-1.0, -2.0]])
    ref = t([[-2.0, -1.0]])
    loss, metrics = loss_of(logp, logp.clone(), t([0.0]), torch.ones(1, 2),
                            ref_logp=ref, beta=0.1)
    assert close(loss, 0.1 * (0.367879 + 0.718282) / 2)   # 0.054308
    assert close(metrics["kl"], (0.367879 + 0.718282) / 2)
    _, metrics = loss_of(logp, logp.clone(), t([0.0]), torch.ones(1, 2),
                         ref_logp=ref, kl_estimator="k2")
    assert close(metrics["kl"], 0.5)


# --------------------------------------------------------------------------- gradients
def test_policy_gradient_at_ratio_one():
    logp, old, adv, mask = _two_seq_batch()
    logp.requires_grad_(True)
    loss, _ = loss_of(logp, old, adv, mask)
    loss.backward()
    # -A / num_tokens on masked tokens: -1/4, +2/4; zero on padding
    assert close(logp.grad, [[-0.25, -0.25, -0.25], [0.5, 0.0, 0.0]])


def test_gspo_sequence_ratio_value_and_gradient():
    old = t([[-1.0, -2.0, -3.0]])
    logp = (old + t([[0.1, 0.3, 7.0]])).requires_grad_(True)   # third token is padding
    mask = t([[1, 1, 0]])
    loss, metrics = loss_of(logp, old, t([1.0]), mask, ratio_level="sequence",
                            aggregation="seq-mean-token-mean", clip_low=10.0, clip_high=10.0)
    s = math.exp(0.2)                                          # 1.221403
    assert close(loss, -s) and close(metrics["ratio_mean"], s)
    loss.backward()
    assert close(logp.grad, [[-s / 2, -s / 2, 0.0]])           # -A * s / |y| = -0.610701
    # identical to differentiating GSPO's sequence objective -A * exp(mean(logp - old))
    lp2 = logp.detach().clone().requires_grad_(True)
    (-torch.exp(((lp2 - old) * mask).sum() / 2)).backward()
    assert close(logp.grad, lp2.grad)
    # with GSPO's tight clip the whole sequence is clipped: no gradient, clip_frac 1
    logp.grad = None
    loss, metrics = loss_of(logp, old, t([1.0]), mask, ratio_level="sequence",
                            clip_low=3e-4, clip_high=4e-4)
    loss.backward()
    assert metrics["clip_frac"] == 1.0 and close(logp.grad, torch.zeros(1, 3))


def test_tis_weights_value_and_gradient():
    old = t([[-1.0, -1.0]])
    behavior = old - t([[math.log(3.0), math.log(0.5)]])   # old/behavior = [3, 0.5] -> cap 2 -> [2, 0.5]
    logp = old.clone().requires_grad_(True)
    loss, metrics = loss_of(logp, old, t([1.0]), torch.ones(1, 2),
                            behavior_logp=behavior, tis_cap=2.0)
    assert close(loss, (-2.0 - 0.5) / 2) and close(metrics["tis_weight_mean"], 1.25)
    loss.backward()
    assert close(logp.grad, [[-1.0, -0.25]])
    # only active when both are given
    loss, metrics = loss_of(logp, old, t([1.0]), torch.ones(1, 2), behavior_logp=behavior)
    assert close(loss, -1.0) and "tis_weight_mean" not in metrics


def test_all_zero_mask_gives_zero_loss_with_grad():
    for agg in AGGS:
        for level in ["token", "sequence"]:
            logp = torch.randn(2, 3).requires_grad_(True)
            loss, metrics = loss_of(logp, torch.randn(2, 3), t([1.0, -1.0]), torch.zeros(2, 3),
                                    aggregation=agg, norm_length=3, ratio_level=level,
                                    ref_logp=torch.randn(2, 3), beta=0.1)
            loss.backward()
            assert loss.item() == 0.0 and torch.isfinite(logp.grad).all()
            assert all(math.isfinite(v) for v in metrics.values())


def test_nan_and_inf_in_padding_are_ignored():
    logp, old, adv, mask = _two_seq_batch()
    logp[1, 1], old[1, 2] = float("nan"), float("inf")
    logp.requires_grad_(True)
    ref = torch.full((2, 3), float("-inf"))
    ref[mask.bool()] = -1.0
    loss, metrics = loss_of(logp, old, adv, mask, ref_logp=ref, beta=0.1,
                            behavior_logp=torch.full((2, 3), float("nan")).masked_fill(mask.bool(), 0.0),
                            tis_cap=2.0)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert all(math.isfinite(v) for v in metrics.values())


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize("call,match", [
    (lambda: group_advantages(t([1.0, 2.0, 3.0]), 2), "multiple of group_size"),
    (lambda: group_advantages(t([1.0, 2.0]), 1), "group_size must be >= 2"),
    (lambda: group_advantages(t([1.0, 2.0]), 2, "ppo"), r"'ppo'.*'grpo', 'dr_grpo', 'rloo'"),
    (lambda: kl_penalty(t([0.0]), t([0.0]), "k4"), r"'k4'.*'k1', 'k2', 'k3'"),
    (lambda: loss_of(*_two_seq_batch(), ratio_level="seq"), r"'seq'.*'token', 'sequence'"),
    (lambda: loss_of(*_two_seq_batch(), aggregation="mean"), r"'mean'.*'token-mean'"),
    (lambda: loss_of(*_two_seq_batch(), kl_estimator="k9"), r"'k9'.*'k3'"),
    (lambda: loss_of(*_two_seq_batch(), aggregation="seq-mean-token-sum-norm"), "norm_length"),
    (lambda: loss_of(*_two_seq_batch(), beta=0.1), "ref_logp"),
])
def test_value_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --------------------------------------------------------------------------- properties
def _batch(seed, n, tlen, tis=False):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, tlen, generator=g, dtype=torch.float64) * 3
    old = logp + 0.5 * torch.randn(n, tlen, generator=g, dtype=torch.float64)
    ref = logp + 0.5 * torch.randn(n, tlen, generator=g, dtype=torch.float64)
    beh = old + 0.5 * torch.randn(n, tlen, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, tlen, generator=g) < 0.7).double()
    kw = dict(ref_logp=ref, beta=0.05)
    if tis:
        kw.update(behavior_logp=beh, tis_cap=2.0)
    return logp, old, adv, mask, kw



@FAST
@given(data=st.data(), b=st.integers(1, 4), g=st.integers(2, 6),
       estimator=st.sampled_from(["grpo", "dr_grpo", "rloo"]))
def test_group_advantages_sum_to_zero(data, b, g, estimator):
    values = data.draw(st.lists(st.one_of(st.sampled_from([0.0, 1.0]), st.floats(-10, 10)),
                                min_size=b * g, max_size=b * g))
    adv = group_advantages(t(values, torch.float64), g, estimator)
    assert adv.shape == (b * g,)
    assert torch.allclose(adv.view(b, g).sum(1), torch.zeros(b, dtype=torch.float64), atol=1e-6)


@FAST
@given(value=st.floats(-100, 100), g=st.integers(2, 8),
       estimator=st.sampled_from(["grpo", "dr_grpo", "rloo"]),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_all_equal_group_gets_exactly_zero(value, g, estimator, dtype):
    rewards = torch.cat([torch.full((g,), value, dtype=dtype), torch.arange(g, dtype=dtype)])
    adv = group_advantages(rewards, g, estimator)
    assert (adv[:g] == 0).all() and (adv[g:] != 0).any()


@FAST
@given(seed=st.integers(0, 2**31), n=st.integers(1, 4), tlen=st.integers(1, 6), pad=st.integers(1, 4),
       agg=st.sampled_from(AGGS), level=st.sampled_from(["token", "sequence"]), tis=st.booleans())
def test_loss_invariant_to_padding(seed, n, tlen, pad, agg, level, tis):
    logp, old, adv, mask, kw = _batch(seed, n, tlen, tis)
    g = torch.Generator().manual_seed(seed + 1)

    def padded(x):
        return torch.cat([x, 50 * torch.randn(n, pad, generator=g, dtype=x.dtype)], dim=1)

    common = dict(aggregation=agg, norm_length=8, ratio_level=level)
    lp1 = logp.clone().requires_grad_(True)
    loss1, m1 = loss_of(lp1, old, adv, mask, **common, **kw)
    lp2 = padded(logp).requires_grad_(True)
    kw2 = {k: padded(v) if torch.is_tensor(v) else v for k, v in kw.items()}
    loss2, m2 = loss_of(lp2, padded(old), adv, torch.cat([mask, torch.zeros(n, pad).double()], 1),
                        **common, **kw2)
    assert torch.allclose(loss1, loss2, atol=1e-10)
    for k in m1:
        assert math.isclose(m1[k], m2[k], abs_tol=1e-10)
    (loss1 + loss2).backward()
    assert torch.allclose(lp1.grad, lp2.grad[:, :tlen], atol=1e-10)
    assert (lp2.grad[:, tlen:] == 0).all()


@FAST
@given(seed=st.integers(0, 2**31), n=st.integers(1, 4), tlen=st.integers(1, 6),
       clip_low=st.floats(0.0, 0.9), clip_high=st.floats(0.0, 5.0),
       agg=st.sampled_from(AGGS), level=st.sampled_from(["token", "sequence"]), tis=st.booleans())
def test_clipping_never_increases_objective(seed, n, tlen, clip_low, clip_high, agg, level, tis):
    logp, old, adv, mask, kw = _batch(seed, n, tlen, tis)
    kw["beta"] = 0.0
    common = dict(aggregation=agg, norm_length=8, ratio_level=level, **kw)
    clipped, _ = loss_of(logp, old, adv, mask, clip_low=clip_low, clip_high=clip_high, **common)
    free, m = loss_of(logp, old, adv, mask, clip_low=1e9, clip_high=1e9, **common)
    assert clipped >= free - 1e-12 and m["clip_frac"] == 0.0
    # per token: the loss of every single masked token
    for i in range(n):
        for j in range(tlen):
            if mask[i, j] and level == "token":
                one = torch.zeros_like(mask)
                one[i, j] = 1
                c, _ = loss_of(logp, old, adv, one, clip_low=clip_low, clip_high=clip_high, **common)
                f, _ = loss_of(logp, old, adv, one, clip_low=1e9, clip_high=1e9, **common)
                assert c >= f - 1e-12


@FAST
@given(seed=st.integers(0, 2**31), n=st.integers(2, 6), tlen=st.integers(1, 6), data=st.data(),
       agg=st.sampled_from(AGGS), level=st.sampled_from(["token", "sequence"]), tis=st.booleans())
def test_micro_batches_sum_to_full_batch(seed, n, tlen, data, agg, level, tis):
    logp, old, adv, mask, kw = _batch(seed, n, tlen, tis)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, n - 1), max_size=3))))
    bounds = [0, *cuts, n]
    common = dict(aggregation=agg, norm_length=8, ratio_level=level)
    lp_full = logp.clone().requires_grad_(True)
    full, _ = loss_of(lp_full, old, adv, mask, **common, **kw)
    full.backward()
    lp_micro = logp.clone().requires_grad_(True)
    total = 0.0
    for a, b in zip(bounds[:-1], bounds[1:]):
        kw_mb = {k: v[a:b] if torch.is_tensor(v) else v for k, v in kw.items()}
        part, _ = loss_of(lp_micro[a:b], old[a:b], adv[a:b], mask[a:b], **common, **kw_mb,
                          num_tokens=int(mask.sum().item()), num_seqs=n)
        part.backward()
        total = total + part.detach()
    assert torch.allclose(total, full.detach(), atol=1e-10)
    assert torch.allclose(lp_micro.grad, lp_full.grad, atol=1e-10)


@FAST
@given(seed=st.integers(0, 2**31), n=st.integers(1, 3), tlen=st.integers(1, 5), v=st.integers(2, 11),
       scale=st.floats(0.1, 30.0), bf16=st.booleans(), chunk=st.sampled_from([None, 1, 7]))
def test_token_logprobs_matches_naive(seed, n, tlen, v, scale, bf16, chunk):
    """chunk: CHUNK_ELEMENTS small enough that the rows go in several chunks (1: one row each)."""
    if chunk is not None:
        old, grpo.CHUNK_ELEMENTS = grpo.CHUNK_ELEMENTS, chunk
    try:
        _check_token_logprobs(seed, n, tlen, v, scale, bf16)
    finally:
        if chunk is not None:
            grpo.CHUNK_ELEMENTS = old


def _check_token_logprobs(seed, n, tlen, v, scale, bf16):
    g = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(n, tlen, v, generator=g)
    ids = torch.randint(0, v, (n, tlen), generator=g)
    if bf16:
        logits = logits.to(torch.bfloat16)
    got = token_logprobs(logits, ids)
    for i in range(n):
        for j in range(tlen):
            row = [float(x) for x in logits[i, j].float()]
            top = max(row)
            naive = row[int(ids[i, j])] - (top + math.log(sum(math.exp(x - top) for x in row)))
            assert math.isclose(float(got[i, j]), naive, abs_tol=1e-4)
            p = [math.exp(x - top) for x in row]
            z = sum(p)
            h = -sum(pk / z * math.log(pk / z) for pk in p if pk > 0)
            assert math.isclose(float(entropy_from_logits(logits)[i, j]), h, abs_tol=1e-4)


def test_every_option_of_the_config_is_a_key_of_grpos_tables():
    """AlgoConfig validates against a copy of grpo.py's tables' keys (learner/config.py: the config check
    imports no torch), so a new variant is its function + a table entry + its name there; this says when not."""
    for key, table in (("advantage_estimator", ADVANTAGE_ESTIMATORS), ("ratio_level", RATIO_LEVELS),
                       ("aggregation", AGGREGATIONS), ("kl_estimator", KL_ESTIMATORS),
                       ("behavior_correction", BEHAVIOR_CORRECTIONS)):
        for name in table:
            assert not AlgoConfig(**{key: name}).problems()
        assert AlgoConfig(**{key: "nope"}).problems() == [f"algo.{key} must be {'|'.join(table)}, got 'nope'"]


# --------------------------------------------------------------------------- unscorable samples (NaN)
@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_unscorable_samples_are_left_out_of_their_group(estimator):
    nan = float("nan")
    # group 1: two unscorable among four = a group of the other two; group 2: no NaN, as before
    adv = group_advantages(t([1.0, nan, 0.0, nan, 1.0, 0.0, 0.0, 1.0]), 4, estimator)
    alone = group_advantages(t([1.0, 0.0]), 2, estimator)
    whole = group_advantages(t([1.0, 0.0, 0.0, 1.0]), 4, estimator)
    assert torch.allclose(adv[[0, 2]], alone) and adv[1] == 0 and adv[3] == 0
    assert torch.equal(adv[4:], whole)  # a group without NaN is computed exactly as before
    assert not torch.isnan(adv).any()


def test_a_group_with_fewer_than_two_scorable_samples_has_no_baseline():
    nan = float("nan")
    for rewards in ([nan, nan, 1.0, nan], [nan] * 4, [2.0, nan, 2.0, 2.0]):
        assert torch.equal(group_advantages(t(rewards), 4), torch.zeros(4))
