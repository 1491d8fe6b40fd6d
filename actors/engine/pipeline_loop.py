"""EnginePipeline: the rollout actor's calls in trainer.mode=pipeline, around its EngineLoop.

A part of actors/rollout.py's RolloutWorker, mixed into its class rather than held by it: the driver's
PipelineFeeder calls these methods on the actor's Ray handle, and Ray finds an actor's remote methods on
its class. It owns the loop (actors/pipeline.py EngineLoop: the engine that never stops), started on the
first call; it reads the engine (`llm`), the config, the tokenizer and stop tokens
(engine/generation.py), the threads (actors/runtime/actor_base.py), the version and the adapter
(engine/weight_updates.py). `_loop_idle` is how the other parts' engine calls keep out of its way.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any

from actors.config import RolloutConfig
from actors.pipeline import EngineLoop, paused


class EnginePipeline:
    """pipeline_start / submit / take / stop, and the guard the other engine calls run under."""

    # Of the actor and its other parts (see the module docstring).
    cfg: RolloutConfig
    llm: Any
    tokenizer: Any
    stop_token_ids: list[int]
    threads: int
    _version: int
    _adapter: Any
    _envs: Any
    _loop: EngineLoop | None = None  # trainer.mode=pipeline: the engine runs on (pipeline_start)

    def pipeline_start(self) -> None:
        """From now on the engine runs continuously: groups go in with pipeline_submit and come back
        finished from pipeline_take. Evaluation (generate) is possible while no group is in flight."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if self._loop is not None:
            return
        if self.cfg.stop or self._envs is not None:
            raise ValueError("trainer.mode=pipeline supports single-turn rollouts without rollout.stop strings")
        cfg = self.cfg

        def params():
            return SamplingParams(
                n=1, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k if cfg.top_k > 0 else 0,
                max_tokens=cfg.max_new_tokens, min_tokens=min(cfg.min_new_tokens, cfg.max_new_tokens),
                stop_token_ids=self.stop_token_ids, skip_special_tokens=True, logprobs=0, detokenize=False,
                output_kind=RequestOutputKind.DELTA)  # each step's new tokens, to stamp with their version

        self._loop = EngineLoop(self.llm, params, lambda ids: self.tokenizer.batch_decode(ids, skip_special_tokens=True),
                                lambda: self._version, cfg.kv_after_update, lambda: self.threads,
                                lora_request=self._adapter.request)

    def pipeline_submit(self, groups: list[tuple[int, list[int], int]]) -> dict:
        """groups: (key, prompt ids, G). Returns the groups in flight here and this process's pid (an
        engine Ray restarted starts its loop on the first call, and the driver sees the new pid)."""
        limit = self.cfg.max_model_len - self.cfg.max_new_tokens
        for key, ids, _ in groups:
            if not 0 < len(ids) <= limit:
                raise ValueError(f"group {key}: prompt of {len(ids)} tokens, limit {limit}")
        self.pipeline_start()
        self._loop.submit(groups)
        return {"in_flight": self._loop.in_flight(), "pid": os.getpid()}

    def pipeline_take(self) -> dict:
        """The groups finished since the last call (PromptRollout, `prompt` = the group's key, every
        completion with per-token `versions`) and the engine's counters (actors/pipeline.py stats)."""
        self.pipeline_start()
        loop = self._loop
        return {"rollouts": loop.take(), "stats": loop.stats(), "in_flight": loop.in_flight(),
                "weight_version": self._version, "pid": os.getpid()}

    def pipeline_stop(self) -> list[int]:
        """Abort the groups in flight and stop the loop; returns their keys (to submit again elsewhere)."""
        if self._loop is None:
            return []
        keys, self._loop = self._loop.stop(), None
        return keys

    @contextlib.contextmanager
    def _loop_idle(self, what: str):
        """`LLM.generate` steps the whole engine: with the pipeline's groups in it, it would step (and
        swallow) them too. So it runs paused, and only with none in flight."""
        with paused(self._loop):
            if self._loop is not None and self._loop.in_flight():
                raise RuntimeError(f"{what} while pipeline groups are in flight on this engine: stop the pipeline first")
            yield
