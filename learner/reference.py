"""ReferenceActor: the frozen starting model, serving per-token log-probs for the KL term.

A plain class; the driver wraps it with `ray.remote(...)` (started only when beta > 0). It is
a transformers model, not a vLLM engine: the KL term compares against the learner's own
(transformers) log-probs, so the same implementation on both sides keeps numerical noise out
of the KL.
"""
from __future__ import annotations

import os

import torch

from actors.runtime.actor_base import ActorBase
from actors.runtime.devices import on_gpu, resolve_dtype
from actors.runtime.start_up import starts_with_few_full_collections
from actors.runtime.threads import use_threads
from learner.config import ReferenceConfig
from learner.sequences import completion_logprobs


class ReferenceActor(ActorBase):
    """The frozen starting model's per-token log-probs (info, network, threads: actors/runtime/actor_base.py)."""

    @starts_with_few_full_collections  # its imports: actors/runtime/start_up.py
    def __init__(self, model_path: str, cfg: ReferenceConfig):
        problems = cfg.problems()
        if problems:
            raise ValueError("invalid ReferenceConfig: " + "; ".join(problems))
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        gpu = on_gpu(cfg.num_gpus)
        # Until the driver's thread budget arrives (set_threads): one thread per CPU share.
        self.threads = cfg.threads or (0 if gpu else int(os.environ.get("OMP_NUM_THREADS", max(1, int(cfg.num_cpus)))))
        use_threads(self.threads)
        dtype = getattr(torch, resolve_dtype(cfg.dtype, gpu))
        self.device = torch.device("cuda" if gpu else "cpu")
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(self.device)
        model.eval()
        model.requires_grad_(False)
        self.model = model
        self.pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def logprobs(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> dict:
        """{"logprobs": log pi_ref(completion token t | prompt, completion[:t]) per completion token, "pid"}: the
        process that answered, by which the driver sees that Ray restarted this actor in place and ran the call
        again (cluster/driver/actor_restarts.py)."""
        use_threads(self.threads)
        return {"logprobs": completion_logprobs(self.model, prompt_ids, completion_ids, self.cfg.micro_batch_size,
                                                self.pad_id, share_prompts=self.cfg.prompt_sharing),
                "pid": os.getpid()}

    def own_info(self) -> dict:
        return {"device": str(self.device), "dtype": str(next(self.model.parameters()).dtype)}
