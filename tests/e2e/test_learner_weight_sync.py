"""The learner's weight broadcast: ZeRO-3 (2 ranks, gathered a layer group at a time) -> a real
vLLM RolloutWorker over the gloo backend, after a real train step.

The check that the weights arrived: vLLM's prompt log-probs equal transformers' log-probs
computed from the learner's consolidated weights (full_state_dict), and differ from before.
The sender's own check (actors/transport/fingerprint.py, run in learner/weight_sync.py WeightSync.send): an
engine that does not hold what was sent fails the sync, naming the engine and a tensor.
"""
from __future__ import annotations

import os
import sys
import time

import pytest
import torch
from learner_ranks import make_batch, on_all, start_ranks, stop

from actors.config import RolloutConfig
from actors.rollout import RolloutWorker
from actors.transport.fingerprint import SyncMismatch
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
    # A large LR so one step moves the log-probs far beyond the tolerance. Every parameter partitioned, so the
    # sync gathers each (at DeepSpeed's default threshold the tiny model's all persist whole on each rank).
    cfg = LearnerConfig(num_ranks=2, zero_stage=3, lr=2e-2, micro_batch_size=2, zero3_param_persistence_threshold=0)
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
    info = ray.get(ranks[0].info.remote())
    assert info["partitioned_params"] == info["param_tensors"] > 0, info
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


def wait_until_gone(ray, actor, timeout_s=60):
    """ray.kill returns before the actor is dead, and a call made just after it may still be served
    (CI saw one answered): ask until a call fails, so that the sync after it cannot reach the engine."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(actor.get_weight_version.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return
        assert time.monotonic() < deadline, f"the killed actor still answers {timeout_s}s after ray.kill"
        time.sleep(0.5)


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
        wait_until_gone(ray, doomed)
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


def leave_the_next_update_out(worker) -> None:
    """Runs inside a RolloutWorker (Ray's __ray_call__): its next weight update goes through the whole
    protocol (the sender's broadcast completes, the version is stamped), but the engine ends it
    holding the weights it had before, as if the update had never been loaded. Once."""
    llm = worker.llm
    start, finish = llm.start_weight_update, llm.finish_weight_update
    saved = []

    def start_and_save(*a, **kw):
        saved.extend(llm.apply_model(lambda m: [p.data.clone() for p in m.parameters()])[0])
        return start(*a, **kw)

    def restore_and_finish(*a, **kw):
        llm.apply_model(lambda m: [p.data.copy_(old) for p, old in zip(m.parameters(), saved)])
        llm.start_weight_update, llm.finish_weight_update = start, finish
        return finish(*a, **kw)

    llm.start_weight_update, llm.finish_weight_update = start_and_save, restore_and_finish


def engine_label(worker) -> str:
    """Inside the RolloutWorker: how its fingerprint report names it (actors/engine/weight_updates.py)."""
    return f"rollout worker {worker.worker_index} (pid {os.getpid()})"


def test_an_update_the_engine_left_out_fails_the_sync_naming_the_engine_and_a_tensor(setup):
    """The engine ends an update holding its old weights, the version stamped as if it had loaded it: only the
    fingerprint tells. Rank 0's sync fails with SyncMismatch through Ray (Ray's error is also an instance of
    its cause's type: what cluster/driver/trainer.py _sync_weights catches to halt the run at that step;
    the halt, its step and the rows kept before it: tests/unit/test_driver_seam_halts.py), naming the engine and
    a tensor that differs; rank 1 is not left in a gather. Every healthy run's rows say `sync_verified`."""
    from ray import cloudpickle

    ray, ranks, rollout, _ = setup
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors cannot import this test module
    ray.get([w.init_weight_sync.remote([rollout], _init_info()) for w in ranks])
    on_all(ray, ranks, "train_step", make_batch(n=8, seed=9))  # weights the engine does not hold yet
    label = ray.get(rollout.__ray_call__.remote(engine_label))
    ray.get(rollout.__ray_call__.remote(leave_the_next_update_out))

    refs = [w.sync_weights.remote(5) for w in ranks]
    with pytest.raises(SyncMismatch) as e:
        ray.get(refs[0], timeout=120)
    ray.get(refs[1], timeout=120)  # the broadcast itself completed: rank 1 returns
    assert ray.get(rollout.get_weight_version.remote()) == "5"  # stamped: the version alone would not tell
    said = str(e.value.cause)  # the message the driver's halt repeats after "step N: "
    assert said.startswith(f"weight sync check failed after the update to version 5: {label} does not hold what "
                           "the learner sent: tensor model."), said
    assert "sampled values differ" in said, said
