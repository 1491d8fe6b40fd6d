"""A `model:PATH` reward model scored on a GPU, in the Ray actor the driver starts for it (reward.model_num_gpus).

Skipped where no GPU is visible (CI has none). On a CPU (test_reward_model.py) the actor's float32 scores equal
transformers' forward of each text alone to 1e-5. Here, with `start_reward_model` as a run calls it:
- float32 (`reward.model_dtype: float32`; torch leaves TF32 off for matrix products): the actor's batched,
  padded scores on the GPU equal transformers' float32 forward of each text alone on the CPU to 1e-4;
- bfloat16 (`reward.model_dtype: auto` on a GPU): batching adds no error of its own: the actor's gap to those
  float32 scores is at most twice bfloat16's own gap (transformers' bfloat16 forward of each text alone on the
  GPU), plus 1e-2; and it still ranks the right sums above the wrong ones as the CPU test asks.
Needs Ray, torch and transformers (a bare GPU image with Ray carried as a wheel will do).
"""
from __future__ import annotations

import pytest
import torch
from reward_samples import right_above_wrong, samples, scored_alone

from cluster.config import load_config
from cluster.launch.placement import start_reward_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def scored_by_the_actor(ray, tiny_model_dir, path, dtype: str) -> tuple[dict, list[float]]:
    cfg = load_config(None, [f"model.path={tiny_model_dir}", "reward.model_num_gpus=0.1", "reward.model_batch_size=5",
                             f"reward.model_dtype={dtype}"])
    actor = start_reward_model(cfg, str(path), None)
    try:
        info = ray.get(actor.info.remote(), timeout=300)
        out = ray.get(actor.score.remote(*samples()), timeout=300)
    finally:
        ray.kill(actor)
    assert out["truncated"] == 0
    return info, out["values"]


def test_a_reward_model_scores_on_the_gpu_as_on_the_cpu(ray_cluster, tiny_model_dir, addition_rm):
    prompts, completions = samples()
    exact = scored_alone(addition_rm, prompts, completions)

    info, fp32 = scored_by_the_actor(ray_cluster, tiny_model_dir, addition_rm, "float32")
    assert info["device"] == "cuda" and info["dtype"] == "torch.float32", info
    diff = max(abs(a - b) for a, b in zip(fp32, exact))
    print(f"float32 on the GPU vs the CPU: max |difference| {diff:.2e}")
    assert diff <= 1e-4

    info, bf16 = scored_by_the_actor(ray_cluster, tiny_model_dir, addition_rm, "auto")
    assert info["device"] == "cuda" and info["dtype"] == "torch.bfloat16", info
    own = max(abs(a - b) for a, b in zip(scored_alone(addition_rm, prompts, completions, torch.bfloat16, "cuda"), exact))
    gap = max(abs(a - b) for a, b in zip(bf16, exact))
    print(f"bfloat16 in the actor vs float32: {gap:.3f}; bfloat16's own (each text alone): {own:.3f}")
    assert gap <= 2 * own + 1e-2
    assert right_above_wrong(bf16) >= 0.6
