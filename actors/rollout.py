"""RolloutWorker: one vLLM engine that samples G completions per prompt, with behaviour log-probs.

A plain class: the driver (and the tests) wrap it with `ray.remote(...)`. Ray runs an actor's
calls one at a time, so a weight update never lands in the middle of a `generate`.

The engine is `vllm.LLM`, which carries vLLM's RL weight-update API. The actor is made of parts, one
concern each, in actors/engine/: generation.py (generate, multi-turn, prompt log-probs),
weight_updates.py (vLLM's weight-update API under the same names, `apply_weight_update` a whole update
in one call, which the learner's client drives: actors/transport/client.py; LoRA adapters; the
fingerprint) and pipeline_loop.py (trainer.mode=pipeline's calls around actors/pipeline.py's
EngineLoop); what every actor answers (info, network, threads) comes from
actors/runtime/actor_base.py. The parts are mixed into this class, not held by it, because Ray finds
an actor's remote methods on its class: the driver calls `generate` and `apply_weight_update` on the
actor's handle. This module builds the engine. What generate returns is in actors/completions.py.

On CPU the engine core runs in the actor by default (`VLLM_ENABLE_V1_MULTIPROCESSING=0`,
rollout.engine_core=auto): vLLM's default would add an engine-core process per engine, which on a
2-core machine costs memory and context switches for nothing. On GPU it runs in its own process
(vLLM's default); rollout.engine_core=process gives a CPU engine that layout too. vLLM loads our
general plugin (actors/transport/vllm_plugin.py) in whichever process builds the model.
"""
from __future__ import annotations

import os
import time

from actors.config import RolloutConfig
from actors.engine.generation import EngineGeneration
from actors.engine.pipeline_loop import EnginePipeline
from actors.engine.weight_updates import EngineWeightUpdates
from actors.runtime.actor_base import ActorBase
from actors.runtime.devices import eager_cpu_engine_env, on_gpu, resolve_dtype, resolve_enforce_eager
from actors.runtime.start_ledger import ENGINE, record_start
from actors.runtime.start_up import starts_with_few_full_collections
from actors.runtime.threads import use_threads
from actors.transport.fingerprint import WORKER_EXTENSION
from actors.transport.registry import backend, resolve_backend
from actors.transport.vllm_plugin import PACK_ABOVE_ENV

CPU_PREFILL_BUDGET = 4096  # tokens per engine step on CPU (vLLM's CPU default)


class RolloutWorker(ActorBase, EngineGeneration, EngineWeightUpdates, EnginePipeline):
    """One vLLM engine. `worker_index` only labels it (logs, `info()`)."""

    @starts_with_few_full_collections  # its imports: actors/runtime/start_up.py
    def __init__(self, model_path: str, cfg: RolloutConfig, worker_index: int = 0, max_lora_rank: int = 0,
                 chat_template_kwargs: dict | None = None):
        """`max_lora_rank` > 0 starts the engine with vLLM's LoRA support (one adapter slot, see
        `load_adapter`); it must be a value vLLM accepts (learner/config.py VLLM_LORA_RANKS).
        `chat_template_kwargs`: how multi-turn rollouts render conversations (data.chat_template_kwargs)."""
        problems = cfg.problems()
        if problems:
            raise ValueError("invalid RolloutConfig: " + "; ".join(problems))
        record_start(ENGINE, worker_index=worker_index)  # the test suite's cost file; a no-op in a user's run
        self.cfg = cfg
        self.worker_index = worker_index
        self.model_path = str(model_path)
        gpu = on_gpu(cfg.num_gpus)
        # Before vLLM is imported: envs are read lazily, but keep it obviously first.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if cfg.engine_core_in_own_process(gpu) else "0"
        if not gpu:
            os.environ.setdefault("OMP_NUM_THREADS", str(cfg.threads or max(1, int(cfg.num_cpus))))
            os.environ[PACK_ABOVE_ENV] = str(cfg.cpu_pack_above_elements)  # read by actors/transport/vllm_plugin.py
            for k, v in eager_cpu_engine_env(cfg.enforce_eager, gpu).items():  # read where vLLM decorates
                os.environ.setdefault(k, v)
        # Until the driver's thread budget arrives (set_threads); vLLM's CPU worker turns
        # torch.set_num_threads into a no-op once it starts, use_threads goes around that.
        self.threads = cfg.threads or (0 if gpu else int(os.environ["OMP_NUM_THREADS"]))
        use_threads(self.threads)
        t0 = time.perf_counter()
        self.llm = self._start_engine(gpu, max_lora_rank)
        self._start_weight_updates()  # version 0; the adapter slot and the pipeline-mode hold
        self._start_generation(chat_template_kwargs)  # tokenizer, stop tokens, environments; the warm-up
        self.start_seconds = time.perf_counter() - t0

    def _start_engine(self, gpu: bool, max_lora_rank: int):
        """vllm.LLM with our weight-transfer backend and fingerprint extension in every worker."""
        from vllm import LLM

        cfg = self.cfg
        kwargs = {}
        if not gpu and cfg.cpu_kv_cache_mb > 0:
            kwargs["kv_cache_memory_bytes"] = cfg.cpu_kv_cache_mb * 1024 * 1024
        if not gpu:
            # vLLM 0.32 CPU: a seeded request whose prefill is split across steps crashes the engine
            # ("CPU Generator does not use offset": the runner rewinds a generator that CPU torch
            # cannot rewind). Whole prefills only: a prompt that does not fit waits for the next step.
            kwargs |= {"enable_chunked_prefill": False, "max_num_batched_tokens": max(CPU_PREFILL_BUDGET, cfg.max_model_len)}
        if max_lora_rank > 0:
            kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1)
        return LLM(
            model=self.model_path,
            dtype=resolve_dtype(cfg.dtype, gpu),
            max_model_len=cfg.max_model_len,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            seed=cfg.seed,
            enforce_eager=resolve_enforce_eager(cfg.enforce_eager, gpu),
            tensor_parallel_size=cfg.tensor_parallel_size,
            logprobs_mode=cfg.logprobs_mode,
            weight_transfer_config=backend(resolve_backend(cfg.weight_transfer_backend, cfg.num_gpus)).engine_config(),
            worker_extension_cls=WORKER_EXTENSION,  # weight_fingerprint reads the weights inside every worker
            **kwargs,
        )

    def own_info(self) -> dict:
        return {"worker_index": self.worker_index, "weight_version": self._version, "updating": self._updating,
                "model_path": self.model_path, "start_seconds": round(self.start_seconds, 2)}
