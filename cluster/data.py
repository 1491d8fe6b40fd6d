"""Prompt datasets: JSONL files and built-in verifiable tasks, in a deterministic, resumable order.

An example is a prompt plus whatever fields its reward needs (`answer` for the arithmetic
tasks). The order is a fresh permutation per epoch drawn from (seed, epoch), so the position
`(epoch, index)` is all a checkpoint needs to continue exactly where the run stopped.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

TASKS = ("addition", "subtraction")


class DataError(ValueError):
    pass


@dataclass(frozen=True)
class Example:
    prompt: str
    fields: dict = field(default_factory=dict)  # passed to the reward functions as keyword arguments


# --------------------------------------------------------------------------- sources


def load_jsonl(path: str | Path) -> list[Example]:
    """One JSON object per line with a string `prompt`; every problem names file and line."""
    out, problems = [], []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                problems.append(f"{path}:{lineno}: not valid JSON ({e.msg})")
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                problems.append(f'{path}:{lineno}: expected an object with a string "prompt", got {line.strip()[:80]!r}')
                continue
            out.append(Example(obj.pop("prompt"), obj))
    if problems:
        shown = problems[:10] + ([f"... and {len(problems) - 10} more"] if len(problems) > 10 else [])
        raise DataError("malformed dataset lines (fix or remove them):\n  " + "\n  ".join(shown))
    if not out:
        raise DataError(f"{path} holds no examples")
    return out


def arithmetic_examples(task: str, digits: int) -> list[Example]:
    """Every pair of `digits`-digit operands, e.g. '12+34=' -> answer '46'."""
    if task not in TASKS:
        raise DataError(f"unknown task {task!r}; built-in tasks: {', '.join(TASKS)}")
    if not 1 <= digits <= 3:
        raise DataError(f"data.task_digits must be 1..3, got {digits}")
    lo, hi = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits
    op = "+" if task == "addition" else "-"
    out = []
    for a in range(lo, hi):
        for b in range(lo, hi):
            if op == "-" and b > a:
                continue
            out.append(Example(f"{a}{op}{b}=", {"answer": str(a + b if op == "+" else a - b)}))
    return out


def load_splits(train: str, eval_path: str, num_eval: int, digits: int, seed: int) -> tuple[list[Example], list[Example]]:
    """(train examples, held-out examples). A task's held-out split is disjoint from its train split."""
    if train.startswith("task:"):
        examples = arithmetic_examples(train.split(":", 1)[1], digits)
        random.Random(f"heldout-{seed}").shuffle(examples)
        held, rest = examples[:num_eval], examples[num_eval:]
        return rest, (load_jsonl(eval_path)[:num_eval] if eval_path else held)
    return load_jsonl(train), (load_jsonl(eval_path)[:num_eval] if eval_path else [])


# --------------------------------------------------------------------------- order


class PromptStream:
    """Examples in a per-epoch permutation of (seed, epoch); `state()` is the resume position."""

    def __init__(self, examples: list[Example], seed: int):
        if not examples:
            raise DataError("the training set is empty")
        self.examples, self.seed = examples, seed
        self.epoch, self.index = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        random.Random(f"{self.seed}-{epoch}").shuffle(order)
        return order

    def take(self, n: int) -> list[Example]:
        out = []
        while len(out) < n:
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            out.append(self.examples[self._order[self.index]])
            self.index += 1
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation(self.epoch)
