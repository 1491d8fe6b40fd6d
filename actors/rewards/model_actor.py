"""Learned reward models: a `reward.functions` entry `model:PATH`, scored as TRL scores one.

PATH is a HF `AutoModelForSequenceClassification` directory with one label; its single logit is
the reward. Each sample is rendered with the reward model's *own* tokenizer and chat template:

- conversational data: the prompt's messages plus the completion as the assistant turn
  (`apply_chat_template(messages, tokenize=False)`, then encoded without adding special tokens,
  which the template already wrote); a multi-turn trajectory is scored on its whole conversation;
- plain strings: `tokenizer(prompt + completion)`, with the tokenizer's own special tokens.

Inputs longer than `reward.model_max_len` (capped at the model's max_position_embeddings) keep
their *last* tokens, where the score is read, and are counted. A tokenizer without a pad token
pads with its EOS token, and a config without `pad_token_id` gets it, as TRL does; transformers
then reads each sequence's score at its last token that is not the pad token.

`RewardModelScorer` is the core (no Ray: the tests and the bench use it directly);
`RewardModelActor` is the Ray actor the driver starts for each entry (model.py: the kind, whose
scorer calls the actor's handle), with its own resources
(`reward.model_num_cpus`, `reward.model_num_gpus`), restarted by Ray when it dies.
"""
from __future__ import annotations

import os
import time

import torch

from actors.config import RewardConfig
from actors.runtime.actor_base import ActorBase
from actors.runtime.devices import on_gpu, resolve_dtype
from actors.runtime.start_up import starts_with_few_full_collections
from actors.runtime.threads import use_threads


class RewardModelScorer:
    """A reward model loaded once; `score` runs it over samples in batches sorted by length."""

    def __init__(self, path: str, cfg: RewardConfig, device: str = "cpu"):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.path, self.cfg, self.device = path, cfg, torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        dtype = getattr(torch, resolve_dtype(cfg.model_dtype, self.device.type == "cuda"))
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype).to(self.device)
        self.model.eval()
        self.model.requires_grad_(False)
        if self.tokenizer.pad_token is None and self.tokenizer.eos_token is not None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        positions = getattr(self.model.config, "max_position_embeddings", None)
        self.max_len = min(cfg.model_max_len, positions) if positions else cfg.model_max_len
        # Without any pad id transformers cannot find a padded sequence's last token: one sequence per pass.
        self.batch_size = cfg.model_batch_size if self.model.config.pad_token_id is not None else 1

    def encode(self, prompt, completion: str, messages: list[dict] | None = None) -> list[int]:
        """The token ids the reward model reads for one sample (before truncation)."""
        conversation = messages if messages else (prompt + [{"role": "assistant", "content": completion}]
                                                  if isinstance(prompt, list) else None)
        if conversation is None:
            return self.tokenizer(prompt + completion)["input_ids"]
        if not self.tokenizer.chat_template:
            raise ValueError(f"the reward model {self.path} has no chat template, but the prompts are chat messages: "
                             "give its tokenizer a chat template (tokenizer_config.json) or use plain-string prompts")
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def score(self, prompts: list, completions: list[str], messages: list | None = None) -> tuple[list[float], int]:
        """(one reward per sample, how many inputs were truncated to max_len)."""
        ids = [self.encode(p, c, m) for p, c, m in zip(prompts, completions, messages or [None] * len(prompts))]
        truncated = sum(len(x) > self.max_len for x in ids)
        ids = [x[-self.max_len:] for x in ids]
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        out = [0.0] * len(ids)
        pad = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else 0
        with torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                rows = order[start:start + self.batch_size]
                width = max(len(ids[i]) for i in rows)
                input_ids = torch.tensor([ids[i] + [pad] * (width - len(ids[i])) for i in rows], device=self.device)
                mask = torch.tensor([[1] * len(ids[i]) + [0] * (width - len(ids[i])) for i in rows], device=self.device)
                logits = self.model(input_ids=input_ids, attention_mask=mask).logits[:, 0].float()
                for i, v in zip(rows, logits.tolist()):
                    out[i] = v
        return out, truncated


class RewardModelActor(ActorBase):
    """One reward model in a Ray actor of its own (the driver wraps it with ray.remote); info, network and
    threads: actors/runtime/actor_base.py."""

    @starts_with_few_full_collections  # its imports: actors/runtime/start_up.py
    def __init__(self, path: str, cfg: RewardConfig):
        gpu = on_gpu(cfg.model_num_gpus)
        # Until the driver's thread budget arrives (set_threads): one thread per CPU share.
        self.threads = 0 if gpu else int(os.environ.get("OMP_NUM_THREADS", max(1, int(cfg.model_num_cpus))))
        use_threads(self.threads)
        self.scorer = RewardModelScorer(path, cfg, "cuda" if gpu else "cpu")

    def score(self, prompts: list, completions: list[str], messages: list | None = None) -> dict:
        use_threads(self.threads)
        t0 = time.perf_counter()
        values, truncated = self.scorer.score(prompts, completions, messages)
        return {"values": values, "truncated": truncated, "seconds": time.perf_counter() - t0, "pid": os.getpid()}

    def own_info(self) -> dict:
        return {"device": str(self.scorer.device), "max_len": self.scorer.max_len,
                "dtype": str(next(self.scorer.model.parameters()).dtype)}
