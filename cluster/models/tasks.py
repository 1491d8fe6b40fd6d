"""The data of the `chat` and `tools` demo recipes, generated from a seed (cluster/demo/recipes.py).

chat   one-digit word problems in TRL's conversational format, answered "a + b = c\\n#### c": what
       the offline chat model can learn on two cores, scored by the `gsm8k` reward.
tools  products of two 3-digit numbers, which a 1M-parameter model cannot compute, with the built-in
       `calculator` environment (actors/multiturn/envs.py) a call `calc(a * b)` away. Each row carries `demo`:
       the supervised continuation the warm start learns from, a call and its use for a fraction
       `tool_fraction` of the rows, a direct (almost always wrong) guess for the rest; the warm start
       thus knows the call's format without making it its habit, and GRPO has to learn to call.
"""
from __future__ import annotations

import random

from cluster.data.dataset import Example
from cluster.models.wordproblems import ITEMS, NAMES, SYSTEM_PROMPT

TOOL_SYSTEM = "Use calc(expression) for arithmetic. End with the answer after ####."


def chat_problem(rng: random.Random, lo: int = 10, hi: int = 99, b_lo: int = 10, b_hi: int = 99) -> tuple[str, str]:
    """(question, worked answer ending in '#### n')."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(lo, hi), rng.randint(b_lo, b_hi)
    if rng.random() < 0.5:
        q = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
        return q, f"{a} + {b} = {a + b}\n#### {a + b}"
    a, b = max(a, b), min(a, b)
    q = f"{name} has {a} {item} and gives away {b}. How many {item} does {name} have left?"
    return q, f"{a} - {b} = {a - b}\n#### {a - b}"


# One worked example, asked and answered as an earlier turn of the conversation (the smollm2 recipe's
# prompts): a pretrained chat model follows a shown turn's format more than a described one.
WORKED_EXAMPLE = [{"role": "user", "content": "Sam has 3 apples and gets 4 more. How many apples does Sam have now?"},
                  {"role": "assistant", "content": "3 + 4 = 7\n#### 7"}]


def chat_rows(n: int, seed: int, worked_example: bool = False, **digits) -> list[dict]:
    """`digits`: chat_problem's operand ranges (the recipe uses 1..9 for both); `worked_example`: put
    WORKED_EXAMPLE between the system prompt and the question."""
    rng = random.Random(f"chat-{seed}")
    shot = WORKED_EXAMPLE if worked_example else []
    rows = []
    for _ in range(n):
        q, answer = chat_problem(rng, **digits)
        rows.append({"prompt": [{"role": "system", "content": SYSTEM_PROMPT}, *shot, {"role": "user", "content": q}],
                     "answer": answer})
    return rows


def tool_rows(n: int, seed: int, tool_fraction: float = 0.3) -> list[dict]:
    rng = random.Random(f"tools-{seed}")
    rows = []
    for _ in range(n):
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        q = f"{name} has {a} boxes of {b} {item}. How many {item} does {name} have?"
        if rng.random() < tool_fraction:
            demo = [{"role": "assistant", "content": f"calc({a} * {b})"}, {"role": "tool", "content": str(a * b)},
                    {"role": "assistant", "content": f"#### {a * b}"}]
        else:
            demo = [{"role": "assistant", "content": f"#### {a * b}"}]
        rows.append({"prompt": [{"role": "system", "content": TOOL_SYSTEM}, {"role": "user", "content": q}],
                     "answer": f"#### {a * b}", "demo": demo})
    return rows


def conversation_sequence(tok, e: Example) -> tuple[list[int], list[int]]:
    """The warm start's sequence for a tools row: the prompt and its `demo` messages rendered with the
    chat template; the loss on the assistant turns' tokens and their end-of-turn token (what the
    model samples), never on the template's or the tool's tokens."""
    msgs = list(e.prompt)
    ids = _ids(tok, msgs, True)
    mask = [0] * len(ids)
    demo = e.fields["demo"]
    for k, m in enumerate(demo):
        full = _ids(tok, msgs + [m], False)
        if m["role"] == "assistant":
            new = full[len(ids):]
            end = new.index(tok.eos_token_id) + 1
            ids, mask = ids + new, mask + [1] * end + [0] * (len(new) - end)
        else:  # the tool's answer and the next assistant turn's opening
            new = (_ids(tok, msgs + [m], True) if k + 1 < len(demo) else full)[len(ids):]
            ids, mask = ids + new, mask + [0] * len(new)
        msgs = msgs + [m]
    return ids, mask


def _ids(tok, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return list(tok.encode(text, add_special_tokens=False))
