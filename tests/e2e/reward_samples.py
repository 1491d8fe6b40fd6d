"""The samples the reward-model actor tests score (no tests here): addition prompts with right and wrong sums, the
reference they are held to (transformers' forward of each text alone), and how often the right sum ranks higher.
Used by test_reward_model.py (CPU) and test_reward_model_gpu.py."""
from __future__ import annotations

import random

import torch

from cluster.data.dataset import arithmetic_examples
from cluster.models.tinyreward import wrong_completion


def samples() -> tuple[list[str], list[str]]:
    """24 addition prompts, every other one (the even ones) with a wrong sum."""
    rng = random.Random(0)
    examples = arithmetic_examples("addition", 2)[:24]
    completions = [e.fields["answer"] if i % 2 else wrong_completion(int(e.fields["answer"]), rng)
                   for i, e in enumerate(examples)]
    return [e.prompt for e in examples], completions


def scored_alone(path, prompts, completions, dtype=torch.float32, device="cpu") -> list[float]:
    """transformers' forward of each text alone: what the actor's batches (sorted, padded) are held to."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype).to(device).eval()
    with torch.no_grad():
        return [model(**tok(p + c, return_tensors="pt").to(device)).logits[0, 0].float().item()
                for p, c in zip(prompts, completions)]


def right_above_wrong(values: list[float]) -> float:
    """The share of the samples' (wrong, right) pairs whose right sum scored higher."""
    right, wrong = values[1::2], values[0::2]
    return sum(r > w for r, w in zip(right, wrong)) / len(right)
