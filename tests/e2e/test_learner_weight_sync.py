"""The learner's weight broadcast: ZeRO-3 (2 ranks, gathered a layer group at a time) -> a real
vLLM RolloutWorker over the gloo backend, after a real train step.

The check that the weights arrived: vLLM's prompt log-probs equal transformers' log-probs
computed from the learner's consolidated weights (full_state_dict), and differ from before.
"""
from __future__ import annotations

import pytest
import torch
from learner_ranks import make_batch, on_all, start_ranks, stop

from actors.config import RolloutConfig
from actors.rollout import RolloutWorker
from learner.config import AlgoConfig, LearnerConfig
from learner.grpo import token_logprobs

pytestmark = pytest.mark.timeout(900)
TOL = 1e-4  # float32 on both sides


def hf_logprobs(model_dir, state_dict, seqs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if state_dict is not None:
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # tied to the embedding
    with torch.no_grad():
        return [token_logprobs(model(input_ids=torch.tensor([s])).logits[:, :-1], torch.tensor([s[1:]]))[0].tolist()
                for s in seqs]


def max_diff(a, b):
    return max(max(abs(x - y) for x, y in zip(ra, rb)) for ra, rb in zip(a, b))


@pytest.fixture(scope="module")
def setup(ray_cluster, engine_pool, tiny_model_dir):
    """The learner's ranks and a warm engine leased from the session's pool (tests/e2e/engine_pool.py), which
    puts the engine's weights back at the module's end."""
    ray = ray_cluster
    # A large LR so one step moves the log-probs far beyond the tolerance.
    cfg = LearnerConfig(num_ranks=2, zero_stage=3, lr=2e-2, micro_batch_size=2)
    ranks = start_ranks(ray, tiny_model_dir, cfg, AlgoConfig())
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (5, 17, 40)]
    with engine_pool.lease(tiny_model_dir) as (rollout,):
        try:
            yield ray, ranks, rollout, seqs
        finally:
            stop(ray, ranks)  # before the pool takes the engine back: no group of the learner's sends to it then


def _init_info(world_size=2):
    return {"backend": "gloo", "master_address": "127.0.0.1", "master_port": 0, "world_size": world_size,
            "bucket_bytes": 1 << 20, "timeout_s": 120}


def test_zero3_broadcast_after_a_step_matches_hf(setup, tiny_model_dir):
    ray, ranks, rollout, seqs = setup
    before = ray.get(rollout.prompt_logprobs.remote(seqs))
    assert max_diff(before, hf_logprobs(tiny_model_dir, None, seqs)) <= TOL  # same checkpoint: agree

    ray.get([w.init_weight_sync.remote([rollout], _init_info()) for w in ranks])
    metrics = on_all(ray, ranks, "train_step", make_batch(n=8, seed=7))
    assert not metrics["skipped"]
    result = on_all(ray, ranks, "sync_weights", 1)
    assert result["weight_version"] == 1 and result["bytes"] > 0 and result["seconds"] > 0
    assert ray.get(rollout.get_weight_version.remote()) == "1"

    after = ray.get(rollout.prompt_logprobs.remote(seqs))
    sd = on_all(ray, ranks, "full_state_dict")
    assert max_diff(after, hf_logprobs(tiny_model_dir, sd, seqs)) <= TOL
    assert max_diff(after, before) > 100 * TOL  # the step moved the weights and the engine got them


def test_rollout_restart_then_reinit_and_sync(setup, tiny_model_dir, tmp_path):
    """An engine of the learner's group dies: the next sync fails fast on rank 0 without leaving rank 1 stuck
    in a ZeRO-3 gather. The engine that dies is one started from the learner's export_hf directory (so that
    export must load in vLLM with the trained weights), attached with init_weight_sync and synced once before
    it is killed: the module's own (a fault, and another model directory), not a pooled one. Then the module's
    engine is re-attached in its place with init_weight_sync, and a further step reaches it."""
    ray, ranks, rollout, seqs = setup
    out = tmp_path / "export"
    on_all(ray, ranks, "export_hf", str(out))
    exported = on_all(ray, ranks, "full_state_dict")

    doomed = ray.remote(num_cpus=0.5)(RolloutWorker).remote(
        str(out), RolloutConfig(max_model_len=128, max_new_tokens=16, cpu_kv_cache_mb=64))
    try:
        assert max_diff(ray.get(doomed.prompt_logprobs.remote(seqs)), hf_logprobs(tiny_model_dir, exported, seqs)) <= TOL
        ray.get([w.init_weight_sync.remote([doomed], _init_info()) for w in ranks])
        assert on_all(ray, ranks, "sync_weights", 2)["weight_version"] == 2
        assert ray.get(doomed.get_weight_version.remote()) == "2"
        ray.kill(doomed)
        refs = [w.sync_weights.remote(3) for w in ranks]
        with pytest.raises(ray.exceptions.RayTaskError):  # the sender's error, not a timeout (a hang)
            ray.get(refs[0], timeout=120)
        ray.get(refs[1], timeout=120)  # released by the sender's drain, not hung
    finally:
        ray.kill(doomed)

    ray.get([w.init_weight_sync.remote([rollout], _init_info()) for w in ranks])
    on_all(ray, ranks, "train_step", make_batch(n=8, seed=8))
    assert on_all(ray, ranks, "sync_weights", 4)["weight_version"] == 4
    assert ray.get(rollout.get_weight_version.remote()) == "4"
    sd = on_all(ray, ranks, "full_state_dict")
    assert max_diff(ray.get(rollout.prompt_logprobs.remote(seqs)), hf_logprobs(tiny_model_dir, sd, seqs)) <= TOL
