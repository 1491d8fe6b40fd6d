"""The session's engine pool (tests/e2e/engine_pool.py) puts back what a test changed on a leased engine, and a
change that leaks past it (a test that used an engine after giving it back) fails the next lease instead of
skewing that test's results. Real Ray and vLLM, on the pool's warm engines."""
from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

import pytest
import torch
from engine_pool import CALL_TIME_FIELDS, POOL_CONFIG, BaseWeights, EngineNotClean
from hf_logprobs import hf_logprobs, max_diff
from pool_scope import POOL_SCOPE, scope

from actors.engine.generation import EngineGeneration
from actors.engine.pipeline_loop import EnginePipeline
from actors.engine.weight_updates import EngineWeightUpdates
from actors.rollout import RolloutWorker

TOL = 1e-4  # float32 on both sides


def noised(model_dir, seed: int) -> BaseWeights:
    """The model's weights moved by noise: what a test that trains or syncs leaves on an engine."""
    weights = BaseWeights(model_dir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in weights.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return weights


def test_what_a_test_changed_is_put_back(engine_pool, tiny_model_dir):
    """Weights, version, call-time settings and a running pipeline loop, all changed: the next lease of the same
    engine finds its settings and weights as the model directory has them (the engine's own log-probs too, not
    only the fingerprint the pool checks), at version 0, its loop stopped."""
    import ray

    base = BaseWeights(tiny_model_dir)
    seqs = [list(range(3, 40)), list(range(50, 60))]
    with engine_pool.lease(tiny_model_dir) as (engine,):
        pid = ray.get(engine.info.remote())["pid"]
        noised(tiny_model_dir, seed=1).resend([engine])
        ray.get(engine.update_weight_version.remote(9))
        ray.get(engine.pipeline_start.remote())
        engine_pool.configure(engine, stop=["\x07"], max_new_tokens=8)  # after: a pipeline refuses stop strings
        assert max_diff(ray.get(engine.prompt_logprobs.remote(seqs)), hf_logprobs(base.model, seqs)) > 100 * TOL

    with engine_pool.lease(tiny_model_dir, len(plain_engines(engine_pool, tiny_model_dir))) as engines:
        (engine,) = [e for e in engines if ray.get(e.info.remote())["pid"] == pid]  # the same process, not a new one
        assert ray.get(engine.get_weight_version.remote()) == "0"
        assert max_diff(ray.get(engine.prompt_logprobs.remote(seqs)), hf_logprobs(base.model, seqs)) <= TOL
        state = ray.get(engine.__ray_call__.remote(lambda w: (w.cfg, w._loop is None)))
        assert state == (POOL_CONFIG, True)


def test_a_change_that_leaks_past_the_lease_fails_the_next_one(engine_pool, tiny_model_dir):
    """Weights changed after the engine was given back, at version 0 (so the version alone would not show it):
    the next lease that gets that engine raises EngineNotClean naming a tensor, and puts the engine back clean."""
    with engine_pool.lease(tiny_model_dir) as (engine,):
        pass
    noised(tiny_model_dir, seed=2).resend([engine])  # the leak: the handle used after the lease ended

    count = len(plain_engines(engine_pool, tiny_model_dir))  # every one: the leaked too
    with pytest.raises(EngineNotClean, match=r"was handed out changed: tensor model\..* sampled values differ"):
        with engine_pool.lease(tiny_model_dir, count):
            pass
    with engine_pool.lease(tiny_model_dir, count):  # put back clean by the failed lease: checked clean again
        pass


def test_the_files_that_use_the_pool_are_one_unit_of_work_for_xdist(pytestconfig):
    """`make test`'s two workers: every file that takes the `engine_pool` fixture goes to the one worker that holds
    the pool (tests/e2e/pool_scope.py); each other file, such as one that starts a stack of its own, stays a unit of
    its own."""
    root = Path(pytestconfig.rootpath)
    files = sorted(p.relative_to(root).as_posix() for p in (root / "tests" / "e2e").glob("test_*.py"))
    pooled = {Path(f).name for f in files if scope(f, root) == POOL_SCOPE}
    assert {"test_rollout.py", "test_multiturn.py", "test_pipeline_engine.py", "test_weight_sync.py",
            "test_learner_weight_sync.py", "test_engine_pool.py", "test_tinymodel_loads.py"} <= pooled, pooled
    assert not pooled & {"test_train.py", "test_smollm2_logprobs.py", "test_multinode.py"}, pooled
    assert all(scope(f, root) == f for f in files if Path(f).name not in pooled)


def plain_engines(engine_pool, model_dir) -> list:
    """The pool's engines on `model_dir` that a lease without a config gets (POOL_CONFIG's)."""
    return [e for e in engine_pool.engines if e.model_dir == str(model_dir) and e.config == POOL_CONFIG]


def test_call_time_settings_are_read_per_call_not_at_start():
    """What `EnginePool.configure` may set on a warm engine (CALL_TIME_FIELDS) is read from the actor's config by
    its calls and by none of the code that starts it: an engine configured so then behaves as one started so. A
    field that starts being read at start-up fails here, before a test trusts a configured engine."""
    at_start = [RolloutWorker.__init__, RolloutWorker._start_engine, EngineGeneration._start_generation,
                EngineGeneration._warm_up, EngineWeightUpdates._start_weight_updates]
    per_call = [EngineGeneration.generate, EngineGeneration.sampling_params, EnginePipeline.pipeline_start]
    read_at_start = set().union(*(config_fields_read(f) for f in at_start))
    assert read_at_start, "no config field found read at start: the check reads nothing"
    assert not read_at_start & CALL_TIME_FIELDS, read_at_start & CALL_TIME_FIELDS
    assert CALL_TIME_FIELDS <= set().union(*(config_fields_read(f) for f in per_call))  # each one is read per call


def config_fields_read(function) -> set[str]:
    """The names X of every `cfg.X` and `self.cfg.X` in a function's source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and (
        (isinstance(node.value, ast.Name) and node.value.id == "cfg")
        or (isinstance(node.value, ast.Attribute) and node.value.attr == "cfg"))}
