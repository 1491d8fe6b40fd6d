"""LearnerWorker with real DeepSpeed (2 ranks on CPU, gloo) against a plain-torch single-process step.

Exactness: 2 ranks x uneven micro-batches (3 sequences per rank, micro-batch 2) must give the
same loss and updated weights as one full-batch step of torch AdamW + grad clipping, to 1e-5.
"""
from __future__ import annotations

import math

import pytest
import torch
from learner_ranks import make_batch, max_weight_diff, on_all, reference_step, start_ranks, stop

from learner.config import AlgoConfig, LearnerConfig

pytestmark = pytest.mark.timeout(900)

TOL = 1e-5
# Adam's first update is ~lr * g / (|g| + eps): a large eps keeps it a smooth function of the
# gradient, so float summation-order noise (different micro-batching) cannot flip a sign on a
# near-zero gradient element and move a weight by a whole lr.
BASE = dict(num_ranks=2, lr=1e-3, adam_eps=1e-4, weight_decay=0.01, grad_clip=0.5, micro_batch_size=2)


def _run_and_compare(ray, ranks, model_dir, cfg, algo, batch, ref=(None, None)):
    metrics = on_all(ray, ranks, "train_step", batch)
    losses, model, opt = reference_step(model_dir, batch, cfg, algo, *ref)
    assert not metrics["skipped"]
    assert metrics["loss"] == pytest.approx(sum(losses) / len(losses), abs=TOL)
    sd = on_all(ray, ranks, "full_state_dict")
    assert max_weight_diff(sd, model) <= TOL
    return metrics, model, opt


@pytest.fixture(scope="module")
def zero2(ray_cluster, tiny_model_dir):
    cfg = LearnerConfig(zero_stage=2, max_nonfinite_steps=2, **BASE)
    algo = AlgoConfig()
    ranks = start_ranks(ray_cluster, tiny_model_dir, cfg, algo)
    yield ranks, cfg, algo
    stop(ray_cluster, ranks)


@pytest.fixture(scope="module")
def zero3_mu2_kl(ray_cluster, tiny_model_dir):
    # every parameter partitioned (at DeepSpeed's default threshold the tiny model's all persist whole)
    cfg = LearnerConfig(zero_stage=3, mu=2, zero3_param_persistence_threshold=0, **BASE)
    algo = AlgoConfig(beta=0.05, kl_estimator="k3", clip_high=0.28, aggregation="seq-mean-token-mean")
    ranks = start_ranks(ray_cluster, tiny_model_dir, cfg, algo)
    yield ranks, cfg, algo
    stop(ray_cluster, ranks)


def test_zero2_step_matches_torch_then_nan_is_skipped(ray_cluster, tiny_model_dir, zero2):
    ranks, cfg, algo = zero2
    batch = make_batch(n=6, seed=1, group_size=3)  # each rank's first micro-batch shares its prompt's forward
    metrics, model, opt = _run_and_compare(ray_cluster, ranks, tiny_model_dir, cfg, algo, batch)
    assert metrics["tokens"] == batch.num_completion_tokens()
    assert metrics["grad_norm"] > 0 and math.isfinite(metrics["grad_norm"])
    assert metrics["lr"] == pytest.approx(cfg.lr)
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(str(tiny_model_dir)).vocab_size
    assert 0 < metrics["entropy"] < math.log(vocab) + 1e-4  # near-uniform for random weights
    for key in ("pg_loss", "clip_frac", "kl", "ratio_mean", "seconds", "nonfinite_count"):
        assert key in metrics

    # NaN advantage: the update is skipped on both ranks and nothing moves (weights, Adam state, LR).
    before = on_all(ray_cluster, ranks, "full_state_dict")
    bad = make_batch(n=6, seed=2)
    bad.advantages[4] = float("nan")  # on rank 1 only: the skip must still be global
    m = on_all(ray_cluster, ranks, "train_step", bad)
    assert m["skipped"] and m["nonfinite_count"] == 1
    after = on_all(ray_cluster, ranks, "full_state_dict")
    assert all(torch.equal(before[k], after[k]) for k in before)

    # A good step in between resets the streak; the update equals the reference's second step.
    good = make_batch(n=6, seed=3)
    _, model, opt = _run_and_compare(ray_cluster, ranks, tiny_model_dir, cfg, algo, good, (model, opt))
    assert on_all(ray_cluster, ranks, "info")["step"] == 3

    bad.advantages[0] = float("inf")
    m = on_all(ray_cluster, ranks, "train_step", bad)
    assert m["skipped"] and m["nonfinite_count"] == 1
    with pytest.raises(Exception, match=r"NaN/inf for 2 consecutive steps at step 5.*last checkpoint"):
        on_all(ray_cluster, ranks, "train_step", bad)


def test_zero3_step_matches_torch_and_inf_loss_is_skipped(ray_cluster, tiny_model_dir, zero3_mu2_kl):
    """ZeRO-3, mu=2 (pi_old frozen before the first pass), KL to a reference, clip-higher, seq-mean.
    Then ref_logp = -inf: the k3 KL (and the loss) is inf while its gradient stays finite, which
    must still skip the update; the next good step again equals the reference's."""
    ranks, cfg, algo = zero3_mu2_kl
    info = ray_cluster.get(ranks[0].info.remote())
    assert info["partitioned_params"] == info["param_tensors"] > 0, info  # each rank holds half of every tensor
    batch = make_batch(n=6, seed=4, with_ref=True)
    metrics, model, opt = _run_and_compare(ray_cluster, ranks, tiny_model_dir, cfg, algo, batch)
    assert metrics["kl"] > 0
    assert metrics["ratio_mean"] != pytest.approx(1.0, abs=1e-7)  # the second pass is off-policy

    before = on_all(ray_cluster, ranks, "full_state_dict")
    bad = make_batch(n=6, seed=5, with_ref=True)
    bad.ref_logp[0][0] = float("-inf")
    m = on_all(ray_cluster, ranks, "train_step", bad)
    assert m["skipped"] and not math.isfinite(m["loss"])
    after = on_all(ray_cluster, ranks, "full_state_dict")
    assert all(torch.equal(before[k], after[k]) for k in before)
    _run_and_compare(ray_cluster, ranks, tiny_model_dir, cfg, algo, make_batch(n=6, seed=6, with_ref=True),
                     (model, opt))


def test_batch_not_divisible_by_ranks_is_a_clear_error(ray_cluster, zero2):
    ranks, _, _ = zero2
    with pytest.raises(Exception, match="does not split evenly over 2 learner ranks"):
        on_all(ray_cluster, ranks, "train_step", make_batch(n=5))


def test_one_rank_runs_without_zero_matches_torch_then_nan_is_skipped(ray_cluster, tiny_model_dir):
    """learner.zero_stage auto on one rank is stage 0 (DeepSpeed without ZeRO): its own NaN check
    (LearnerWorker._optimizer_step) skips a poisoned update, and the steps equal plain torch's."""
    cfg = LearnerConfig(**{**BASE, "num_ranks": 1})
    assert cfg.zero_stage == 0
    ranks = start_ranks(ray_cluster, tiny_model_dir, cfg, AlgoConfig())
    try:
        assert on_all(ray_cluster, ranks, "info")["zero_stage"] == 0
        _, model, opt = _run_and_compare(ray_cluster, ranks, tiny_model_dir, cfg, AlgoConfig(),
                                         make_batch(n=6, seed=1, group_size=3))
        before = on_all(ray_cluster, ranks, "full_state_dict")
        bad = make_batch(n=6, seed=2)
        bad.advantages[4] = float("nan")
        m = on_all(ray_cluster, ranks, "train_step", bad)
        assert m["skipped"] and m["nonfinite_count"] == 1 and not math.isfinite(m["grad_norm"])
        after = on_all(ray_cluster, ranks, "full_state_dict")
        assert all(torch.equal(before[k], after[k]) for k in before)
        _run_and_compare(ray_cluster, ranks, tiny_model_dir, cfg, AlgoConfig(), make_batch(n=6, seed=3), (model, opt))
    finally:
        stop(ray_cluster, ranks)
