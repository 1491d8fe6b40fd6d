"""The data of the `code` demo recipe: small Python functions to write, each checked by MBPP-style asserts
(`test_list`), scored by the `code_tests` reward (actors/rewards/code.py), generated from a seed.

A task is a family (sum a range, count a letter, the last items of a list, ...) and a constant:
`sum_from_7(x)` returns 7 + 8 + ... + x. The held-out split's constants are never the training split's, so a
held-out function (its name and what it must do) never appears in training: the model has to generalise the
family, not recall the function. Each row also carries `solution`, a reference program that passes its
tests (the unit tests score it; training never reads it).

The families were screened on SmolLM2-135M-Instruct (greedy on every held-out function, 8 samples at
temperature 0.7 on every training one; max_new_tokens 48) to be neither solved nor hopeless: the base
model's greedy program is wrong for most held-out functions of max_plus, count_letter, last_k and
count_greater (it writes `len(s) % 2 == 0` for count_l, `len(xs) - 8` for last_8), and its samples still
pass every test 12-42% of the time on the training constants, the signal GRPO needs. power_minus_one and
repeat it mostly solves greedily but not when sampled (33%, 48% of samples pass); sum_range half. An earlier
set (add_k, times_k, is_multiple_of_k, is_under_k, square_plus_k) started at 0.87 held-out: no room to learn.
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


def _numbers(k: int) -> list[int]:
    """A list of 2k + 3 small integers, negatives among them, that depends on k."""
    return [(7 * i + 3 * k) % 23 - 5 for i in range(2 * k + 3)]


def _family(kind: str, k: int) -> tuple[str, str, str, str, list]:
    """(function name, its argument, what it must do, its body, inputs to test it on)."""
    c = "abcdefghijklmnopqrstuvwxyz"[k]  # count_letter's letter: the training and held-out letters differ too
    xs = _numbers(k)
    return {
        "sum_range": (f"sum_from_{k}", "x", f"returns the sum of the whole numbers from {k} to x, both included "
                      f"(0 if x < {k})", f"sum(range({k}, x + 1))", [k, k + 1, k + 5, 0, 3 * k]),
        "repeat": (f"repeat_{k}", "s", f"returns the string s repeated {k} times", f"s * {k}", ["ab", "", "x"]),
        "power_minus_one": (f"power_{k}_minus_1", "x", f"returns x raised to the power {k}, minus 1", f"x ** {k} - 1",
                            [0, 1, 2, -1, 3]),
        "count_greater": (f"count_greater_than_{k}", "xs", f"returns how many numbers in the list xs are greater "
                          f"than {k}", f"sum(1 for v in xs if v > {k})", [xs, [], [k, k + 1]]),
        "max_plus": (f"max_plus_{k}", "xs", f"returns the largest number in the list xs, plus {k}", f"max(xs) + {k}",
                     [xs, [-5], [3, 3]]),
        "count_letter": (f"count_{c}", "s", f"returns how many times the letter '{c}' occurs in the string s",
                         f"s.count({c!r})", ["", c, f"x{c}y{c}{c}", f"{c * 3}b{c}", "hello world"]),
        "last_k": (f"last_{k}", "xs", f"returns the last {k} items of the list xs", f"xs[-{k}:]",
                   [xs, xs[:k + 1], xs[:2]]),
    }[kind]


KINDS = ("sum_range", "repeat", "power_minus_one", "count_greater", "max_plus", "count_letter", "last_k")


def code_task(kind: str, k: int) -> dict:
    """One row: the prompt (system, the worked turn, the question), `test_list` and the reference `solution`."""
    name, arg, does, body, inputs = _family(kind, k)
    solution = f"def {name}({arg}):\n    return {body}\n"
    scope: dict = {}
    exec(solution, scope)  # the expected values come from the reference itself
    tests = [f"assert {name}({x!r}) == {scope[name](x)!r}" for x in inputs]
    question = f"Write a Python function `{name}({arg})` that {does}."
    return {"prompt": [{"role": "system", "content": SYSTEM}, *WORKED_EXAMPLE, {"role": "user", "content": question}],
            "test_list": tests, "solution": f"```python\n{solution}```", "function": name}


def code_rows(n: int, seed: int, constants: tuple[int, ...]) -> list[dict]:
    """n rows drawn (with repeats: GRPO samples each prompt G times anyway) from the families x `constants`."""
    rng = random.Random(f"code-{seed}")
    tasks = [code_task(kind, k) for kind in KINDS for k in constants]
    return [rng.choice(tasks) for _ in range(n)]
