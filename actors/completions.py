"""What an engine returns, and the small helpers that build it: a prompt's rollout (its G
completions with behaviour log-probs, or why it was skipped), a vLLM output as a Completion, the
stop tokens of a model, and how a list is shared out among engines. No vLLM import: the driver
and the scorer read these too.
"""
from __future__ import annotations

from dataclasses import dataclass

FINISH_REASONS = ("stop", "length")


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # behaviour log-prob of each sampled token, from vLLM
    text: str  # decoded without special tokens (no <|im_end|>): what reward functions see
    finish_reason: str  # "stop" (EOS, an eos_token_id of generation_config.json, a stop string) | "length"
    # per token, the weight version that sampled it (trainer.mode=pipeline, actors/pipeline.py: an update
    # may land mid-request); None: every token is the rollout's `weight_version` (sync, async)
    versions: list[int] | None = None


@dataclass
class PromptRollout:
    prompt: str | list[int] | int  # as given to generate(): token ids (the driver's) or a string; pipeline: the group's key
    prompt_ids: list[int]
    completions: list[Completion]  # G of them; empty when the prompt was skipped
    weight_version: int  # the engine's version (pipeline: the oldest of its tokens')
    skipped: str | None = None  # why the prompt was skipped (e.g. too long)

    def training_rows(self) -> list[tuple]:
        """Per completion, what the learner trains on: (prompt_ids, completion_ids, behavior_logp,
        loss_mask); loss_mask None = every completion token is the model's (multi-turn rollouts,
        actors/multiturn/trajectories.py, answer the same call with their environment tokens masked)."""
        return [(self.prompt_ids, c.token_ids, c.logprobs, None) for c in self.completions]


def split_evenly(items: list, n: int) -> list[list]:
    """Split `items` into `n` contiguous chunks whose sizes differ by at most one (the first
    chunks take the extra items). Concatenating the per-chunk results in order,
    `[x for chunk in results for x in chunk]`, restores the original order."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    size, extra = divmod(len(items), n)
    chunks, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        chunks.append(list(items[start:end]))
        start = end
    return chunks


def stop_token_ids(model_path: str, eos_token_id: int | None) -> list[int]:
    """The tokenizer's EOS and every `eos_token_id` listed in generation_config.json (chat models
    list several, e.g. Qwen2.5's `<|im_end|>` and `<|endoftext|>`)."""
    ids = [] if eos_token_id is None else [eos_token_id]
    try:
        from transformers import GenerationConfig

        listed = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json
        listed = None
    ids += listed if isinstance(listed, list) else ([] if listed is None else [listed])
    return list(dict.fromkeys(int(i) for i in ids))


def completion_from_vllm(c, text: str | None = None) -> Completion:
    """A vLLM CompletionOutput as a Completion; `text` replaces c.text (a request with detokenize=False)."""
    token_ids = list(c.token_ids)
    # logprobs=0 returns, per position, a dict holding (at least) the sampled token.
    logprobs = [float(step[tok].logprob) for tok, step in zip(token_ids, c.logprobs or [])]
    if len(logprobs) != len(token_ids):
        raise RuntimeError(f"vLLM returned {len(logprobs)} log-probs for {len(token_ids)} tokens")
    if c.finish_reason not in FINISH_REASONS:  # e.g. "abort": never a sample to train on
        raise RuntimeError(f"vLLM ended a request with finish_reason {c.finish_reason!r}")
    return Completion(token_ids, logprobs, c.text if text is None else text, c.finish_reason)
