"""transformers' own log-probs, the yardstick the engine and learner tests compare against (no tests here).

Imports neither vLLM nor Ray, so the GPU tests that run on a bare image use it too."""
from __future__ import annotations

import torch

from learner.grpo import token_logprobs


def chat(tokenizer, user: str, answer: str | None = None) -> list[int]:
    """The chat template's ids for one user turn: the prompt (a generation prompt after it), or with
    `answer` the whole transcript."""
    messages = [{"role": "user", "content": user}] + ([{"role": "assistant", "content": answer}] if answer else [])
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=answer is None, return_dict=True)["input_ids"])


def hf_logprobs(model, seqs: list[list[int]]) -> list[list[float]]:
    """log p(token t | tokens < t) for t >= 1 of each sequence, one forward pass each, on the CPU."""
    with torch.no_grad():
        return [token_logprobs(model(input_ids=torch.tensor([s])).logits[:, :-1], torch.tensor([s[1:]]))[0].tolist()
                for s in seqs]


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(max(abs(x - y) for x, y in zip(ra, rb)) for ra, rb in zip(a, b))
