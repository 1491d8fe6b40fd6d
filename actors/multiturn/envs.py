"""Environments for multi-turn rollouts: the contract, the built-ins, and the isolated pool that runs them.

The contract (`rollout.env: path/to/file.py:ClassName`, or a built-in name from ENVS):

    class MyEnv:
        def __init__(self, **example_fields): ...       # one instance per trajectory
        def reset(self) -> list[dict] | None: ...        # messages to add before the first turn
        def step(self, assistant_text: str) -> dict: ... # after every assistant turn:
            # {"messages": [{"role": "tool" | "user", "content": str}, ...],  (may be empty)
            #  "done": bool, "reward": float (optional, added to the trajectory's reward)}

Tools are the environment's business: it reads the assistant's text and answers in messages.

Environment code runs in separate processes (actors/multiturn/env_pool.py), with a deadline per call: a
call that raises, returns something outside the contract, passes its deadline or kills its
process fails *its* trajectory only: the caller ends that trajectory and counts an env error.

Deliberately light: no torch import, so the processes start fast.
"""
from __future__ import annotations

import math
import numbers
import os
import re

from actors.runtime.user_code import is_file_spec, load_file_function

ROLES = ("system", "user", "assistant", "tool")
ENVS: dict[str, type] = {}


def register_env(name: str):
    def deco(cls):
        ENVS[name] = cls
        return cls

    return deco


# --------------------------------------------------------------------------- #
# Built-in: a calculator tool for word problems
# --------------------------------------------------------------------------- #
_CALL = re.compile(r"calc\(([^()]*(?:\([^()]*\)[^()]*)*)\)")
_SAFE_EXPR = re.compile(r"[0-9+\-*/(). ]+")


def safe_eval(expr: str) -> str:
    """Arithmetic only (digits, + - * / parentheses, decimals): the answer as text, or an error text."""
    if not _SAFE_EXPR.fullmatch(expr) or len(expr) > 200 or "**" in expr:
        return "error: only numbers, + - * / and parentheses"
    try:
        value = eval(compile(expr, "<calc>", "eval"), {"__builtins__": {}}, {})  # noqa: S307 - charset checked above
    except ZeroDivisionError:
        return "error: division by zero"
    except Exception:  # noqa: BLE001 - a malformed expression is the model's mistake, answered as text
        return "error: malformed expression"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 6) if isinstance(value, float) else value)


# A system prompt that tells the model about the tool (the data carries it: the system prompt lives in the data).
CALC_SYSTEM_PROMPT = ("Solve the problem. You may write calc(expression) to use a calculator; its result comes "
                      "back in the next message. End with the answer after ####.")


@register_env("calculator")
class CalculatorEnv:
    """The model may write `calc(<expression>)` in a turn; the environment answers with a `tool`
    message holding the result, and the model continues. A turn without a call ends the episode
    (its text is the final answer, scored by the reward functions). `answer` (if the data has
    one) is not used here: scoring is the rewards' job."""

    def __init__(self, **fields):
        self.fields = fields

    def reset(self):
        return None

    def step(self, assistant_text: str) -> dict:
        calls = _CALL.findall(assistant_text)
        if not calls:
            return {"messages": [], "done": True}
        return {"messages": [{"role": "tool", "content": safe_eval(c.strip())} for c in calls], "done": False}


# --------------------------------------------------------------------------- #
# Loading and checking what an environment returns
# --------------------------------------------------------------------------- #
def env_spec_problems(spec: str) -> list[str]:
    """What is wrong with `rollout.env` (checked at start, before any actor runs)."""
    if not spec or spec in ENVS:
        return []
    if not is_file_spec(spec):
        return [f"rollout.env {spec!r} is neither a built-in environment ({', '.join(sorted(ENVS))}) "
                "nor user code as 'path/to/file.py:ClassName'"]
    path = spec.rpartition(":")[0]
    if not os.path.isfile(path):
        return [f"rollout.env file not found: {path} (from {spec!r}, cwd {os.getcwd()})"]
    return []


def load_env_class(spec: str):
    if spec in ENVS:
        return ENVS[spec]
    cls = load_file_function(spec)  # any callable attribute: a class is one
    for method in ("reset", "step"):
        if not callable(getattr(cls, method, None)):
            raise TypeError(f"{spec} has no method {method}(): an environment needs reset() and step(assistant_text)")
    return cls


def check_messages(messages, where: str) -> list[dict]:
    if messages is None:
        return []
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"{where} returned messages of type {type(messages).__name__}, expected a list of dicts")
    out = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise TypeError(f"{where} returned the message {m!r:.120}; expected {{'role': one of {ROLES}, "
                            "'content': str}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def check_step(result) -> dict:
    if not isinstance(result, dict):
        raise TypeError(f"step() returned {type(result).__name__} {result!r:.80}, expected a dict "
                        "with 'messages', 'done' and optionally 'reward'")
    unknown = set(result) - {"messages", "done", "reward"}
    if unknown:
        raise TypeError(f"step() returned unknown keys {sorted(unknown)}")
    if not isinstance(result.get("done"), bool):
        raise TypeError(f"step() returned done={result.get('done')!r}, expected True or False")
    reward = result.get("reward")
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
            raise TypeError(f"step() returned reward={reward!r}, expected a finite number")
        reward = float(reward)
    return {"messages": check_messages(result.get("messages"), "step()"), "done": result["done"],
            "reward": reward or 0.0}
