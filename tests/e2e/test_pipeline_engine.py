"""trainer.mode=pipeline, the engine's side (real Ray, real vLLM): an update lands mid-request.

Three engines run continuously (actors/pipeline.py), all warm engines leased from the session's pool
(tests/e2e/engine_pool.py: kv_after_update and the 300-token sampling are read when the loop starts, so they are
set on the leased engines; the pool puts back their weights and settings and stops their loops at the module's
end): one per `rollout.kv_after_update` choice, and a third (recompute) whose vLLM engine core runs in its own
process (`rollout.engine_core=process`, VLLM_ENABLE_V1_MULTIPROCESSING=1: the layout every GPU engine has), where
the core steps on its own and only a scheduler pause stops it (actors/update_hold.py). The core's process is
chosen when the engine starts: the third is the pool's OWN_CORE_PACKED_CONFIG engine, which test_weight_sync.py
leases for its packed GEMM (its linear layers from oneDNN-packed copies, rebuilt at each update: the same checks
hold there). The test patches that core's worker (trace_steps) and puts it back (untrace_steps).
The test process stands in for the learner (as in test_weight_sync.py): it holds the HF model, noises it and
sends it through the gloo transport with the learner's one-trip client while long requests run. Checked in one run, for every engine:
  - the update lands while requests are running: a completion's tokens carry version 0, then 1;
  - recompute: every token's vLLM log-prob equals the HF model's of the weights that sampled it
    (version 0 tokens: the old weights, version 1 tokens: the new ones) to 1e-5: so each token's
    version is that of the weights that computed it, outputs queued by the core across the update too;
  - keep: the version-1 tokens' mismatch is measured (printed) and larger than recompute's;
  - no stale prefix: a request submitted after the update with the same prompt (its first 128-token
    block cached under the old weights) has log-probs of the new weights, on every engine;
  - the engine core in its own process ran no model step between the start and the finish of the
    update: its vLLM worker (in the core's process) writes down the time of every model step and of
    start_weight_update / finish_weight_update (trace_steps).
"""
from __future__ import annotations

import os
import sys
import time

import pytest
import torch
from engine_pool import OWN_CORE_PACKED_CONFIG

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


ENGINES = ("recompute", "keep", "recompute, core in its own process")
OWN_CORE = 2  # the index of the engine whose core runs in its own process


def trace_steps(worker) -> int:
    """Runs inside the vLLM worker of an engine (`collective_rpc`; with the core in its own process and TP 1,
    the worker lives in the core's process): from now on every model step with its scheduled tokens, and
    every start_weight_update and finish_weight_update, is written down with its begin and end on this
    process's monotonic clock. Returns the worker's pid."""
    w = getattr(worker, "worker", worker)  # vLLM's WorkerWrapperBase holds the worker
    trace = w.raygrpo_trace = []
    w.raygrpo_untraced = {name: getattr(w, name) for name in ("execute_model", "start_weight_update",
                                                              "finish_weight_update")}

    def timed(name, fn, tokens=lambda *a: 0):
        def call(*args, **kwargs):
            t0 = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                trace.append((name, t0, time.monotonic(), tokens(*args)))
        return call

    w.execute_model = timed("step", w.execute_model, lambda scheduled, *_: scheduled.total_num_scheduled_tokens)
    w.start_weight_update = timed("start", w.start_weight_update)
    w.finish_weight_update = timed("finish", w.finish_weight_update)
    return os.getpid()


def read_trace(worker) -> list:
    return getattr(worker, "worker", worker).raygrpo_trace


def untrace_steps(worker) -> bool:
    """The worker as before trace_steps (a pooled engine: the next lease finds it unpatched)."""
    w = getattr(worker, "worker", worker)
    for name, original in w.__dict__.pop("raygrpo_untraced").items():
        setattr(w, name, original)
    del w.raygrpo_trace
    return True


@pytest.fixture(scope="module")
def setup(engine_pool, tiny_model_dir):
    import ray
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # trace_steps travels to the engine by value
    sampling = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS}
    assert OWN_CORE_PACKED_CONFIG.engine_core == "process"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    with engine_pool.lease(tiny_model_dir, 2) as (recompute, keep), \
            engine_pool.lease(tiny_model_dir, config=OWN_CORE_PACKED_CONFIG) as (own_core,):
        engine_pool.configure(recompute, **sampling, kv_after_update="recompute")
        engine_pool.configure(keep, **sampling, kv_after_update="keep")
        engine_pool.configure(own_core, **sampling, kv_after_update="recompute")
        yield ray, [recompute, keep, own_core], model, tok, engine_pool.config()


@pytest.fixture(scope="module")
def update_mid_request(setup):
    """One update landing while two 300-token requests run on every engine, then the same prompt again.
    Returns per engine {0: the spanning group, 1: the group submitted after}, the own-core engine's step
    trace with its worker's and actor's pids, and the model's old and new weights."""
    from vllm.distributed.weight_transfer import ModuleSource

    from actors.transport.gloo_trainer import GlooTrainerInitInfo, GlooTrainerWeightTransferEngine, default_master_address

    ray, workers, model, tok, cfg = setup
    prompt = tok.encode("12+34=46, " * 15 + "9+9=")  # > 128 tokens: vLLM-CPU caches whole 128-token blocks
    assert len(prompt) > 128
    ray.get([w.pipeline_start.remote() for w in workers])
    own_core = workers[OWN_CORE]
    (core_pid,) = ray.get(own_core.__ray_call__.remote(lambda self: self.llm.collective_rpc(trace_steps)))
    actor_pid = ray.get(own_core.info.remote())["pid"]
    init = GlooTrainerInitInfo(master_address=default_master_address(), master_port=0,
                               world_size=1 + len(workers), bucket_bytes=cfg.bucket_mb << 20, timeout_s=120, rank=0)
    client = OneTripRayClient(workers)
    sender = GlooTrainerWeightTransferEngine.trainer_init(init, client=client, source=ModuleSource(model))
    old = {n: p.detach().clone() for n, p in model.named_parameters()}

    ray.get([w.pipeline_submit.remote([(0, prompt, 2)]) for w in workers])
    t0 = time.time()  # wait until every engine is decoding, then update
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
    for name, w in zip(ENGINES, workers):
        groups = {ro.prompt: ro for ro in wait_done(ray, w, 2)}
        stats = ray.get(w.pipeline_take.remote())["stats"]
        assert stats["updates"] == 1 and stats["pause_s"] > 0
        results[name] = groups
    (trace,) = ray.get(own_core.__ray_call__.remote(lambda self: self.llm.collective_rpc(read_trace)))
    assert ray.get(own_core.__ray_call__.remote(lambda self: self.llm.collective_rpc(untrace_steps))) == [True]
    new_state = {n: p.detach().clone() for n, p in model.named_parameters()}
    yield results, (trace, core_pid, actor_pid), model, old, new_state
    sender.shutdown()
    assert ray.get([w.pipeline_stop.remote() for w in workers]) == [[], [], []]


def test_update_lands_mid_request_versions_logprobs_and_no_stale_prefix(update_mid_request):
    results, _, model, old, new_state = update_mid_request
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
    assert mismatch["recompute"] <= TOL and mismatch[ENGINES[OWN_CORE]] <= TOL
    assert mismatch["keep"] > 10 * TOL  # the kept KV of the old weights shows: the choice is real


def test_an_engine_core_in_its_own_process_runs_no_step_during_an_update(update_mid_request):
    _, (trace, core_pid, actor_pid), *_ = update_mid_request
    assert core_pid != actor_pid  # the GPU layout: the model steps in the core's process, not in the actor
    (start,) = [t for t in trace if t[0] == "start"]
    (finish,) = [t for t in trace if t[0] == "finish"]
    steps = [(t0, t1) for name, t0, t1, tokens in trace if name == "step" and tokens > 0]
    during = [(round(t0 - start[1], 4), round(t1 - start[1], 4)) for t0, t1 in steps if t1 > start[1] and t0 < finish[2]]
    print(f"update: start {start[1]:.4f}, finish ended {finish[2] - start[1]:.4f} s later; "
          f"{len(steps)} model steps with tokens, {len(during)} of them during the update")
    assert not during, f"model steps ran between start_weight_update and the end of finish_weight_update: {during}"
    assert any(t1 <= start[1] for _, t1 in steps) and any(t0 >= finish[2] for t0, _ in steps)  # it landed mid-run
