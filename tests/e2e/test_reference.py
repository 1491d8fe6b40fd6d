"""ReferenceActor in Ray: log-probs that do not depend on batching, equal to a plain HF forward."""
from __future__ import annotations

import pytest
import torch

from learner.config import ReferenceConfig
from learner.grpo import token_logprobs
from learner.reference import ReferenceActor
from learner.sequences import pack_sequences

TOL = 1e-5


@pytest.fixture(scope="module")
def reference(ray_cluster, tiny_model_dir):
    import ray

    cfg = ReferenceConfig(micro_batch_size=3)
    actor = ray.remote(num_cpus=cfg.num_cpus)(ReferenceActor).remote(str(tiny_model_dir), cfg)
    yield actor
    ray.kill(actor)


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(0)
    lengths = [(3, 5), (10, 1), (1, 12), (7, 0), (20, 9), (4, 4), (2, 30)]  # (prompt, completion)
    prompts = [torch.randint(3, 90, (p,), generator=g).tolist() for p, _ in lengths]
    completions = [torch.randint(3, 90, (c,), generator=g).tolist() for _, c in lengths]
    return prompts, completions


def plain_hf(model_dir, prompt, completion) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    x = torch.tensor([prompt + completion])
    with torch.no_grad():
        lp = token_logprobs(model(input_ids=x).logits[:, :-1], x[:, 1:])[0]
    return lp[len(prompt) - 1:].tolist()


def test_batch_composition_does_not_matter(reference, batch):
    import ray

    prompts, completions = batch
    together = ray.get(reference.logprobs.remote(prompts, completions))["logprobs"]
    assert [len(x) for x in together] == [len(c) for c in completions]
    for i in range(len(prompts)):
        (alone,) = ray.get(reference.logprobs.remote([prompts[i]], [completions[i]]))["logprobs"]
        assert len(alone) == len(together[i])
        if alone:
            assert max(abs(a - b) for a, b in zip(alone, together[i])) <= TOL, i


def test_matches_plain_hf_forward(reference, batch, tiny_model_dir):
    import ray

    prompts, completions = batch
    got = ray.get(reference.logprobs.remote(prompts, completions))["logprobs"]
    for i in (0, 4, 6):
        expected = plain_hf(tiny_model_dir, prompts[i], completions[i])
        assert max(abs(a - b) for a, b in zip(got[i], expected)) <= TOL
        assert all(x < 0 for x in got[i])


def test_pack_sequences_layout():
    ids, mask, pos, comp = pack_sequences([[5, 6], [7]], [[8], [9, 10, 11]], pad_id=0)
    assert ids.tolist() == [[5, 6, 8, 0], [7, 9, 10, 11]]
    assert mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert pos.tolist() == [[0, 1, 2, 0], [0, 1, 2, 3]]
    assert comp.tolist() == [[False, False, True, False], [False, True, True, True]]
