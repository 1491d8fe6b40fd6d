"""The data of the `code` demo recipe: small Python functions to write, each checked by MBPP-style asserts
(`test_list`), scored by the `code_tests` reward (actors/rewards/code.py), generated from a seed.

A task is a family (add a constant, multiply, test divisibility, ...) and a constant: `add_7(x)` returns
x + 7. The held-out split's constants are never the training split's, so a held-out function (its name
and what it must do) never appears in training: the model has to generalise the family, not recall the
function. Each row also carries `solution`, a reference program that passes its tests (the unit tests
score it; training never reads it).
"""
from __future__ import annotations

import random

SYSTEM = ("You write Python. Answer with one ```python code block that defines the function asked for, "
          "and nothing else.")
# One worked turn before the question: a small instruct model follows a shown format more than a described one.
WORKED_EXAMPLE = [{"role": "user", "content": "Write a Python function `sub_3(x)` that returns x minus 3."},
                  {"role": "assistant", "content": "```python\ndef sub_3(x):\n    return x - 3\n```"}]
TRAIN_CONSTANTS = (2, 4, 5, 6, 7, 10)
HELD_OUT_CONSTANTS = (8, 9, 11, 12)  # none of these functions is trained on


def _family(kind: str, k: int) -> tuple[str, str, str, list]:
    """(function name, what it must do, its body, inputs to test it on)."""
    xs = [0, 1, 5, -3, 2 * k + 1]
    return {
        "add": (f"add_{k}", f"returns x plus {k}", f"x + {k}", xs),
        "times": (f"times_{k}", f"returns x multiplied by {k}", f"x * {k}", xs),
        "multiple": (f"is_multiple_of_{k}", f"returns True if x is a multiple of {k}, else False", f"x % {k} == 0",
                     [0, k, k + 1, 3 * k, -k]),
        "under": (f"is_under_{k}", f"returns True if x is less than {k}, else False", f"x < {k}", [0, k - 1, k, k + 5]),
        "square_plus": (f"square_plus_{k}", f"returns x squared plus {k}", f"x * x + {k}", xs),
    }[kind]


KINDS = ("add", "times", "multiple", "under", "square_plus")


def code_task(kind: str, k: int) -> dict:
    """One row: the prompt (system, the worked turn, the question), `test_list` and the reference `solution`."""
    name, does, body, inputs = _family(kind, k)
    solution = f"def {name}(x):\n    return {body}\n"
    scope: dict = {}
    exec(solution, scope)  # the expected values come from the reference itself
    tests = [f"assert {name}({x}) == {scope[name](x)!r}" for x in inputs]
    question = f"Write a Python function `{name}(x)` that {does}."
    return {"prompt": [{"role": "system", "content": SYSTEM}, *WORKED_EXAMPLE, {"role": "user", "content": question}],
            "test_list": tests, "solution": f"```python\n{solution}```", "function": name}


def code_rows(n: int, seed: int, constants: tuple[int, ...]) -> list[dict]:
    """n rows drawn (with repeats: GRPO samples each prompt G times anyway) from the families x `constants`."""
    rng = random.Random(f"code-{seed}")
    tasks = [code_task(kind, k) for kind in KINDS for k in constants]
    return [rng.choice(tasks) for _ in range(n)]
