"""Lent cores (async schedule on CPU): a learner rank trains with the threads the collecting side
lent it for one train call, through the "lend" concurrency group, and gives them back when it ends."""
from __future__ import annotations

import pytest
from learner_ranks import make_batch, start_ranks, stop

from learner.config import AlgoConfig, LearnerConfig

pytestmark = pytest.mark.timeout(600)


def test_lent_threads_apply_to_their_own_step_only(ray_cluster, tiny_model_dir):
    ray = ray_cluster
    (rank,) = start_ranks(ray, tiny_model_dir, LearnerConfig(num_ranks=1, zero_stage=2, micro_batch_size=2),
                          AlgoConfig(), lendable=True)
    lend = rank.lend_threads.options(concurrency_group="lend")
    ray.get(rank.set_threads.remote(1))
    batch = make_batch(n=6, seed=1)
    assert ray.get(rank.train_step.remote(batch))["train_threads_max"] == 1  # step 0: nothing lent

    ray.get(lend.remote(1, 2))  # an offer for train call 1, the next one
    assert ray.get(rank.train_step.remote(batch))["train_threads_max"] == 2
    assert ray.get(rank.info.remote())["torch_threads"] == 1  # given back when the step ended
    assert ray.get(rank.train_step.remote(batch))["train_threads_max"] == 1  # call 2: that offer was for call 1

    # Sent while the step runs (what the driver does once the next batch is collected): not queued
    # behind train_step, and taken at one of its micro-batches.
    long_batch = make_batch(n=64, seed=2)
    step = rank.train_step.remote(long_batch)
    ray.get(lend.remote(3, 2))
    assert ray.get(step)["train_threads_max"] == 2
    stop(ray, [rank])
