"""Warm RolloutWorker engines shared by the engine-level e2e files (issue 58 item 2: one warm stack where the
tests' actions cannot disturb each other). tests/e2e/conftest.py's `engine_pool` fixture holds one per pytest
process (under `make test`, one per xdist worker: the one that runs every file using it).

A test file leases engines for as long as it needs them (`lease`, usually from a module fixture) and gives them
back at its end. What a test may change on a leased engine is put back when it is given back, and checked when
it is next leased:
  - the weights: resent from the model directory at version 0 (our gloo transport, as the learner sends them)
    when the engine no longer holds them;
  - the call-time settings (`configure`) back to the config the engine started with;
  - trainer.mode=pipeline's loop stopped (groups still in flight are aborted).
Every lease first checks its engines are clean: weight version 0, the fingerprint of the model directory's
weights (actors/transport/fingerprint.py), the config it started with, no pipeline loop, no update under way, no LoRA
adapter. A leak between tests then fails the next lease loudly (EngineNotClean) instead of skewing its results.
An engine that died while leased (a test killed it) is dropped; the next lease that needs one starts a new one.

Engines are pooled by model directory and start-time config. Most users lease POOL_CONFIG's (the longest context
the users need, a small fixed KV cache); settings an engine reads on every call rather than at start
(CALL_TIME_FIELDS) differ per test through `configure`. Where users need an engine that differs at start, one
named config serves all of them, so that the pool starts it once: CHAT_CONFIG (the chat model's engine, with a
multi-turn environment) and OWN_CORE_PACKED_CONFIG (a core in its own process, packed GEMM). A test whose engine
differs at start otherwise (another model directory such as an export, a fault) starts its own, saying why.

Under `make test` the files that use the pool run on one xdist worker (tests/e2e/pool_scope.py), so each of
these engines starts once per suite, not once per worker.
"""
from __future__ import annotations

import dataclasses
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from actors.config import RolloutConfig
from actors.rollout import RolloutWorker
from actors.transport.fingerprint import Recorder, differences
from cluster.launch.ray_cluster import worker_runtime_env

# 512: test_pipeline_engine's 154-token prompt + 300 new tokens (the tiny models' max_position_embeddings).
POOL_CONFIG = RolloutConfig(max_model_len=512, max_new_tokens=16, cpu_kv_cache_mb=64)
# The chat model's engine for every user of that model (test_rollout, test_tinymodel_loads, test_multiturn): it
# runs the scripted environment of test_multiturn (scripted_env.py; rollout.env and its processes start with the
# engine), which the other users' plain `generate` calls never touch.
CHAT_CONFIG = dataclasses.replace(POOL_CONFIG, env=f"{Path(__file__).with_name('scripted_env.py')}:Scripted",
                                  max_turns=3, env_timeout_s=3.0, env_num_procs=2)
# One engine unlike the others at start in the two ways its users need, both read when it starts: its vLLM core in
# a process of its own (rollout.engine_core=process, the layout of every GPU engine: test_pipeline_engine) and its
# linear layers computed from oneDNN-packed copies that each update rebuilds (rollout.cpu_pack_above_elements=0:
# test_weight_sync).
OWN_CORE_PACKED_CONFIG = dataclasses.replace(POOL_CONFIG, engine_core="process", cpu_pack_above_elements=0)
# Read from the actor's cfg on each call (actors/engine/generation.py, pipeline_loop.py: pipeline_start reads
# kv_after_update and the sampling fields when the loop starts), never when the engine starts: a test may set
# them on a pooled engine and gets what an engine started with them would do.
CALL_TIME_FIELDS = frozenset({"max_new_tokens", "min_new_tokens", "long_prompt", "stop", "kv_after_update",
                              "temperature", "top_p", "top_k"})
CHECK_TIMEOUT_S = 120


class EngineNotClean(AssertionError):
    """A leased engine is not as the pool hands engines out: a test before left something changed."""


def _engine_state(worker) -> dict:
    """Inside the actor (Ray's __ray_call__): what a test may leave changed besides the weights."""
    return {"cfg": worker.cfg, "pipeline": worker._loop is not None, "updating": worker._updating,
            "adapter": worker._adapter.request is not None, "version": worker._version}


def _set_cfg(worker, cfg: RolloutConfig) -> None:
    worker.cfg = cfg


class BaseWeights:
    """One model directory's weights as the test process loads them: what a clean engine holds (its fingerprint
    at version 0), and the source the pool resends them from."""

    def __init__(self, model_dir: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.expected = Recorder(0)
        for name, p in self.model.named_parameters():
            self.expected.add(name, p)

    def differences(self, handle) -> list[str]:
        """Why the engine does not hold these weights at version 0 ([] when it does)."""
        import ray

        report = ray.get(handle.weight_fingerprint.remote(self.expected.shapes, 0), timeout=CHECK_TIMEOUT_S)
        problems = [] if str(report["version"]) == "0" else [f"weight version {report['version']}, expected 0"]
        for held in report["workers"]:
            problems += differences(self.expected, held)
        return problems

    def resend(self, handles: list) -> None:
        """The weights again, at version 0, through the project's gloo transport (one full update)."""
        sender = send_weights(handles, self.model, version=0, bucket_bytes=POOL_CONFIG.bucket_mb << 20,
                              timeout_s=CHECK_TIMEOUT_S)
        sender.shutdown()


def send_weights(handles: list, model, version: int, bucket_bytes: int, timeout_s: float = 120.0,
                 shared_memory: bool = True):
    """`model`'s weights to the RolloutWorker `handles` as the learner sends them (our gloo transport, vLLM's
    Ray client), stamped `version`; the sender, for a test to read or to shut down."""
    from vllm.distributed.weight_transfer import ModuleSource, RayVLLMWeightSyncClient

    from actors.transport.gloo_trainer import GlooTrainerInitInfo, GlooTrainerWeightTransferEngine, default_master_address

    init = GlooTrainerInitInfo(master_address=default_master_address(), master_port=0, world_size=1 + len(handles),
                               bucket_bytes=bucket_bytes, timeout_s=timeout_s, rank=0, shared_memory=shared_memory)
    sender = GlooTrainerWeightTransferEngine.trainer_init(init, client=RayVLLMWeightSyncClient(handles),
                                                          source=ModuleSource(model))
    try:
        sender.send_weights(weight_version=version)
    except BaseException:
        sender.shutdown()
        raise
    return sender


@dataclasses.dataclass
class PooledEngine:
    handle: object
    model_dir: str
    config: RolloutConfig  # what it started with, and what the pool puts back
    index: int
    leased: bool = False


class EnginePool:
    """RolloutWorker engines per model directory and start config, started when first needed and kept warm."""

    def __init__(self, ray):
        self.ray = ray
        self.engines: list[PooledEngine] = []
        self.weights: dict[str, BaseWeights] = {}
        self.next_index = 0
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors cannot import tests/e2e

    @staticmethod
    def config(**fields) -> RolloutConfig:
        """POOL_CONFIG with `fields`: the config of a test's own engine, which differs from the pool's only there."""
        return dataclasses.replace(POOL_CONFIG, **fields)

    @contextmanager
    def lease(self, model_dir: Path, count: int = 1, config: RolloutConfig = POOL_CONFIG):
        """`count` engines on `model_dir` started with `config` (POOL_CONFIG, or a named one above), each checked
        clean, for the `with` block; put back clean after it."""
        model_dir = str(model_dir)
        idle = [e for e in self.engines if e.model_dir == model_dir and e.config == config and not e.leased]
        while len(idle) < count:
            idle.append(self._start(model_dir, config))
        taken = idle[:count]
        for e in taken:
            e.leased = True
        try:
            for e in taken:
                self._check_clean(e)
            yield [e.handle for e in taken]
        finally:
            self._give_back(taken)

    def configure(self, handle, **settings) -> None:
        """Set call-time settings on a leased engine (relative to the config it started with); put back when it is
        given back."""
        start_time = set(settings) - CALL_TIME_FIELDS
        if start_time:
            raise ValueError(f"{sorted(start_time)} take effect when an engine starts: start an engine of the test's "
                             f"own (EnginePool.config) instead of configuring a pooled one")
        cfg = dataclasses.replace(self._leased(handle).config, **settings)
        if cfg.problems():
            raise ValueError("; ".join(cfg.problems()))
        self.ray.get(handle.__ray_call__.remote(_set_cfg, cfg))

    @contextmanager
    def configured(self, handle, **settings):
        """`configure` for the `with` block only, then the engine's settings as they were before it."""
        before = self.ray.get(handle.__ray_call__.remote(_engine_state))["cfg"]
        self.configure(handle, **settings)
        try:
            yield handle
        finally:
            self.ray.get(handle.__ray_call__.remote(_set_cfg, before))

    def close(self) -> None:
        for e in self.engines:
            self.ray.kill(e.handle)
        self.engines.clear()

    # ---- inside
    def _start(self, model_dir: str, config: RolloutConfig) -> PooledEngine:
        # vLLM sends a Python function to a core in another process (collective_rpc, as test_pipeline_engine's
        # trace_steps) only with pickle allowed
        options = {"num_cpus": config.num_cpus}
        if config.engine_core == "process":
            options["runtime_env"] = worker_runtime_env({"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})
        handle = self.ray.remote(**options)(RolloutWorker).remote(model_dir, config, worker_index=self.next_index)
        e = PooledEngine(handle, model_dir, config, self.next_index)
        self.next_index += 1
        try:
            self.ray.get(handle.info.remote())  # up, or its start-up error here
        except BaseException:
            self.ray.kill(handle)
            raise
        self.engines.append(e)
        return e

    def _base(self, model_dir: str) -> BaseWeights:
        if model_dir not in self.weights:
            self.weights[model_dir] = BaseWeights(Path(model_dir))
        return self.weights[model_dir]

    def _leased(self, handle) -> PooledEngine:
        for e in self.engines:
            if e.handle == handle and e.leased:
                return e
        raise ValueError("configure: not an engine leased from this pool")

    def _check_clean(self, e: PooledEngine) -> None:
        state = self.ray.get(e.handle.__ray_call__.remote(_engine_state), timeout=CHECK_TIMEOUT_S)
        problems = [f"{k} is {state[k]!r}" for k in ("pipeline", "updating", "adapter") if state[k]]
        if state["cfg"] != e.config:
            problems.append(f"its config is {state['cfg']}, not the {e.config} it started with")
        if not problems:  # weight_fingerprint refuses an engine mid-update
            problems += self._base(e.model_dir).differences(e.handle)
        if problems:
            raise EngineNotClean(f"pooled engine {e.index} ({e.model_dir}) was handed out changed: "
                                 + "; ".join(problems[:5]))

    def _give_back(self, taken: list[PooledEngine]) -> None:
        """Stop a pipeline, the engine's own config, the weights resent where they changed; a dead engine dropped."""
        alive = []
        for e in taken:
            try:
                self.ray.get(e.handle.pipeline_stop.remote(), timeout=CHECK_TIMEOUT_S)
                self.ray.get(e.handle.__ray_call__.remote(_set_cfg, e.config), timeout=CHECK_TIMEOUT_S)
            except self.ray.exceptions.RayActorError:  # a test killed it: the next lease starts another
                self.engines.remove(e)
                continue
            alive.append(e)
        for model_dir in {e.model_dir for e in alive}:
            base = self._base(model_dir)
            ours = [e for e in alive if e.model_dir == model_dir]
            changed = [e.handle for e in ours if self._changed(base, e.handle)]
            if changed:
                base.resend(changed)
        for e in alive:
            e.leased = False

    def _changed(self, base: BaseWeights, handle) -> bool:
        try:
            return bool(base.differences(handle))
        except self.ray.exceptions.RayTaskError:  # mid-update (weight_fingerprint refuses): the resend ends it
            return True
