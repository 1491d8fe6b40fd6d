"""Built-in reward functions and their registry (light: no torch, so reward processes start fast).

Per-sample form: `fn(prompt, completion, **fields) -> float`. `prompt` is the dataset's prompt
(a string or a list of chat messages), `completion` the generated text (special tokens
removed), `fields` the row's other columns plus what the scorer knows (`_num_tokens`,
`_finish_reason`, `_max_new_tokens`, `_overlong_buffer`, `_answer_key` = reward.answer_key).

`gsm8k` and `math_verify` grade final answers against the column `reward.answer_key` names
(default `answer`). `math_verify` runs in the scorer's worker processes (ISOLATED), since sympy
can take unbounded time on odd input: there the scorer's timeout bounds it, and math-verify's
own signal.alarm timeouts, which fail off the main thread, are switched off.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation

REWARDS: dict[str, Callable[..., float]] = {}


def register(name: str):
    """Decorator: make `fn` available as `RewardConfig.functions` entry `name`."""

    def deco(fn):
        REWARDS[name] = fn
        return fn

    return deco


# --------------------------------------------------------------------------- #
# Built-ins
# --------------------------------------------------------------------------- #
# A number: optional sign, digits with optional thousands commas ("1,234"), optional decimals.
_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[+-]?\.\d+")
_BARE_NUMBER = re.compile(rf"\s*(?:{_NUMBER.pattern})\s*")


def parse_number(text: str) -> Decimal | None:
    """'46', '46.0', ' +46 ', '1,000' -> Decimal; anything else -> None."""
    try:
        return Decimal(str(text).strip().replace(",", ""))
    except (InvalidOperation, ValueError):
        return None


def final_answer(completion: str) -> str | None:
    """The answer a completion gives: the first number after the last "answer:" if there is
    one, else the first number after the last "=", else the last number in the text."""
    lowered = completion.lower()
    for marker in ("answer:", "="):
        at = lowered.rfind(marker)
        if at >= 0:
            found = _NUMBER.search(completion, at + len(marker))
            if found:
                return found.group()
    numbers_ = _NUMBER.findall(completion)
    return numbers_[-1] if numbers_ else None


def _answer(fields: dict, key: str, fn: str):
    if fields.get(key) is None:
        raise KeyError(f"{fn} needs the answer column {key!r} (reward.answer_key) in the example; "
                       f"it has: {', '.join(k for k in fields if not k.startswith('_')) or 'no columns'}")
    return fields[key]


@register("exact_match")
def exact_match(prompt, completion: str, _answer_key: str = "answer", **fields) -> float:
    """1.0 if the completion's final answer equals the example's answer (column reward.answer_key,
    default `answer`) as a number ("46" == "46.0" == "+46"), else 0.0. A non-numeric answer is
    compared as stripped, case-insensitive text against the whole completion."""
    answer = _answer(fields, _answer_key, "exact_match")
    expected = parse_number(answer)
    if expected is None:
        return float(completion.strip().lower() == str(answer).strip().lower())
    got = final_answer(completion)
    return float(got is not None and parse_number(got) == expected)


@register("format")
def format_reward(prompt: str, completion: str, _finish_reason: str | None = None, **_) -> float:
    """1.0 if the completion is just a number (surrounding whitespace allowed, nothing else)
    and generation ended by itself (EOS / a stop string: `_finish_reason == "stop"`, when the
    scorer knows it), else 0.0. Teaches "answer, then stop" on the arithmetic tasks."""
    if _finish_reason is not None and _finish_reason != "stop":
        return 0.0
    return float(_BARE_NUMBER.fullmatch(completion) is not None)


@register("overlong_penalty")
def overlong_penalty(prompt: str, completion: str, _num_tokens: int | None = None,
                     _max_new_tokens: int | None = None, _overlong_buffer: int = 8, **_) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025): 0 up to max_new_tokens - buffer
    tokens, then linear down to -1 at max_new_tokens (and -1 beyond)."""
    if _num_tokens is None or _max_new_tokens is None:
        raise KeyError("overlong_penalty needs _num_tokens and _max_new_tokens (pass Completion objects "
                       "or set them in the example, and max_new_tokens to score())")
    free = _max_new_tokens - _overlong_buffer
    if _num_tokens <= free:
        return 0.0
    if _num_tokens >= _max_new_tokens or _overlong_buffer <= 0:
        return -1.0
    return (free - _num_tokens) / _overlong_buffer


# GSM8K marks the final answer with "#### <number>" (in the gold solution and, once taught, in completions).
_GSM8K_FINAL = re.compile(rf"####\s*\$?\s*({_NUMBER.pattern})")


def gsm8k_gold(answer) -> Decimal:
    """The number after the answer's last "####", or the answer itself when it is a plain number."""
    text = str(answer)
    found = _GSM8K_FINAL.findall(text)
    value = parse_number(found[-1] if found else text.strip().lstrip("$"))
    if value is None:
        raise ValueError(f"gsm8k: the answer {text[-60:]!r} has no '#### <number>' and is not a number")
    return value


@register("gsm8k")
def gsm8k(prompt, completion: str, _answer_key: str = "answer", **fields) -> float:
    """1.0 if the number after the completion's last "####" equals the answer's (numerically;
    "1,000" == "1000" == "1000.0"), else 0.0 (also when the completion has no "####")."""
    gold = gsm8k_gold(_answer(fields, _answer_key, "gsm8k"))
    found = _GSM8K_FINAL.findall(completion)
    return float(bool(found) and parse_number(found[-1]) == gold)


@register("math_verify")
def math_verify(prompt, completion: str, _answer_key: str = "answer", **fields) -> float:
    """1.0 if the `math-verify` package judges the completion's answer (its last \\boxed{} or final
    expression) equal to the gold answer, else 0.0. Gold is the answer column, read as LaTeX;
    a bare answer ("0.5", "\\frac{1}{2}") is read as if boxed, a GSM8K one by its "####" part."""
    from math_verify import verify

    gold = math_verify_gold(_answer(fields, _answer_key, "math_verify"))
    return float(verify(gold, _math_parse(completion), timeout_seconds=None))


def _math_parse(text: str) -> list:
    from math_verify import parse

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns on every call with timeouts off
    # Timeouts off: they use signal.alarm, which raises off the main thread. The scorer bounds the call.
    return parse(text, parsing_timeout=None)


def math_verify_gold(answer) -> list:
    """math-verify's reading of a gold answer: read as LaTeX, a bare one ("0.5") as if boxed, a GSM8K
    one by its "####" part (`raygrpo data` shows it)."""
    gold_text = str(answer)
    if "####" in gold_text:
        gold_text = gold_text.rsplit("####", 1)[1].strip()
    if "\\boxed" not in gold_text and "$" not in gold_text:
        gold_text = "\\boxed{" + gold_text + "}"
    gold = _math_parse(gold_text)
    if not gold:
        raise ValueError(f"math_verify: cannot parse the gold answer {gold_text[:60]!r}")
    return gold


# Built-ins run in the scorer's worker processes (bounded by reward.timeout_s), not in the driver.
ISOLATED = frozenset({"math_verify"})
# Built-ins whose value is a correctness verdict (held-out evaluation uses the first one configured).
ANSWER_CHECKERS = ("gsm8k", "math_verify", "exact_match")
