"""examples/single_gpu.yaml's placement on a GPU, as a run places it (cluster/launch/placement.py), short of the engine.

Skipped where no GPU is visible (CI has none). The example shares one GPU: `ray.placement: colocate` puts learner
rank 0 (0.5 GPU) and the engine (0.4) in one bundle of the placement group, the reference actor (0.1) in another.
Here `place_bundles` plans and reserves those bundles and, as `create_actors` does for colocate, `start_learners`
and `start_reference` start LearnerWorker and ReferenceActor in theirs. Shown:
- the bundles carry the example's GPU shares, and Ray reserves one whole GPU for them;
- each actor sees the GPU Ray gave it and holds its model there, in bfloat16 (dtype auto on a GPU);
- a learner step (DeepSpeed over NCCL) with the reference actor's log-probs as its KL target: KL about 0 at
  the first step (both hold the same weights; they batch differently, so bfloat16 rounds them apart a little),
  finite losses, and a larger KL once the policy moved.

The engine is not started: its GPU path needs vLLM's GPU build, which the machines this ran on did not have
(docs/STATUS.md). Needs Ray, torch, transformers and DeepSpeed (a bare GPU image with them carried as wheels will do).
"""
from __future__ import annotations

import math
import socket
from pathlib import Path

import pytest
import torch
from learner_ranks import make_batch

from cluster.config import load_config
from cluster.driver.worker_groups import LearnerGroup
from cluster.launch.network import bundle_nodes
from cluster.launch.placement import learner_port_key, place_bundles, scheduling, start_learners, start_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "single_gpu.yaml"


def test_the_single_gpu_examples_learner_and_reference_are_placed_on_the_gpu_and_train_against_each_other(
        ray_cluster, tiny_model_dir, tmp_path):
    ray = ray_cluster
    cfg = load_config(EXAMPLE, [f"model.path={tiny_model_dir}", f"trainer.run_dir={tmp_path / 'run'}",
                                "learner.micro_batch_size=2", "learner.lr=1e-3", "algo.beta=0.05",
                                "reference.placement=actor", "trainer.actor_timeout_s=300",
                                "rollout.max_model_len=256", "rollout.max_new_tokens=16"])  # the tiny model: 512 positions
    assert cfg.ray.placement == "colocate" and not cfg.reference_on_learner()
    gpus = ray.cluster_resources().get("GPU", 0)
    assert gpus >= 1, ray.cluster_resources()

    pg, plan, engines = place_bundles(cfg, with_reference=True, num_reward_models=0)
    learners, reference = [], None
    try:
        assert engines == 1 and plan.learners == plan.rollouts == [0]  # learner rank 0 and the engine share bundle 0
        assert plan.bundles[0]["GPU"] == pytest.approx(cfg.learner.num_gpus + cfg.rollout.num_gpus)
        assert plan.bundles[plan.reference]["GPU"] == pytest.approx(cfg.reference.num_gpus)
        assert ray.available_resources().get("GPU", 0) == pytest.approx(gpus - 1.0)  # 0.5 + 0.4 + 0.1 reserved
        nodes = bundle_nodes(pg)
        learners = start_learners(cfg, [scheduling(pg, b, nodes[b], soft=False) for b in plan.learners], "127.0.0.1",
                                  learner_port_key(), socket.gethostname())
        reference = start_reference(cfg, scheduling(pg, plan.reference, nodes[plan.reference], soft=True))
        (rank,) = ray.get([h.info.remote() for h in learners], timeout=300)
        ref = ray.get(reference.info.remote(), timeout=300)
        assert rank["device"].startswith("cuda") and rank["zero_stage"] == 1, rank  # the example's stage
        assert ref["device"] == "cuda" and ref["dtype"] == "torch.bfloat16", ref

        group, rows = LearnerGroup(learners, timeout_s=300), []
        for seed in (1, 2):
            batch = make_batch(seed=seed)
            scored = ray.get(reference.logprobs.remote(batch.prompt_ids, batch.completion_ids), timeout=300)
            batch.ref_logp = scored["logprobs"]
            assert [len(x) for x in batch.ref_logp] == [len(c) for c in batch.completion_ids]
            rows.append(group.train(batch))
        assert all(math.isfinite(r["loss"]) and not r["skipped"] for r in rows), rows
        assert abs(rows[0]["kl"]) < 1e-3 and rows[1]["kl"] > abs(rows[0]["kl"]), rows
    finally:
        for h in (*learners, *([reference] if reference else [])):
            ray.kill(h)
        ray.util.remove_placement_group(pg)
