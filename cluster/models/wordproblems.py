"""Tiny word problems with GSM8K-style answers ("... #### 7"), generated from a seed.

Used twice: as the text the offline chat model's BPE tokenizer is trained on
(cluster/models/tinychat.py), and as the conversational dataset of the CPU chat example and the tests
(`write_jsonl`), so that what the tokenizer saw is what the model is asked.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ("Tom", "Ana", "Li", "Sam", "Mia", "Ben", "Zoe", "Raj")
ITEMS = ("apples", "pens", "books", "coins", "cards", "eggs", "shells", "stamps")
SYSTEM_PROMPT = "Solve the problem. End with the answer after ####."


def word_problem(rng: random.Random) -> tuple[str, int, str]:
    """(question, answer, worked solution ending in '#### answer')."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    if rng.random() < 0.5:
        q = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
        answer, work = a + b, f"{a} + {b} = {a + b}"
    else:
        a, b = max(a, b), min(a, b)
        q = f"{name} has {a} {item} and gives away {b}. How many {item} does {name} have left?"
        answer, work = a - b, f"{a} - {b} = {a - b}"
    return q, answer, f"{name} has {work} {item}.\n#### {answer}"


def conversational_rows(n: int, seed: int = 0, system_prompt: str | None = SYSTEM_PROMPT) -> list[dict]:
    """TRL's conversational format: `prompt` is a list of messages; `answer` is GSM8K-style."""
    rng = random.Random(f"wordproblems-{seed}")
    rows = []
    for _ in range(n):
        q, _answer, solution = word_problem(rng)
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
        rows.append({"prompt": messages + [{"role": "user", "content": q}], "answer": solution})
    return rows


def write_jsonl(path: str | Path, rows: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path
