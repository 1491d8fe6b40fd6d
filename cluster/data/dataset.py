"""Prompt datasets: files (via cluster/data/files.py) and built-in tasks, rendered for the model,
in a deterministic, resumable order.

An example is a prompt (a string or a list of chat messages, as the dataset has it) plus every
other column of its row, which the reward functions get as keyword arguments (`answer` for the
arithmetic tasks). `load_run_data` renders every prompt once, on the driver, with the model's
tokenizer (cluster/data/render.py), keeps those token ids on the example (the engine receives
exactly them), and filters prompts too long for the engine. The order is a fresh permutation
per epoch drawn from (seed, epoch), so the position `(epoch, index)` is all a checkpoint needs
to continue exactly where the run stopped.
"""
from __future__ import annotations

import ast
import collections
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from actors.rewards.functions import ANSWER_CHECKERS
from actors.runtime.user_code import is_file_spec
from cluster.data.files import DataError, raise_problems, read_rows
from cluster.data.model_check import tokenizer_problems
from cluster.data.render import LengthReport, PromptFormat, length_filter, prompt_problem, render, text_content

TASKS = ("addition", "subtraction")
__all__ = ["DataError", "Example", "PromptStream", "RunData", "reward_column_problem", "load_run_data", "load_splits",
           "load_tokenizer"]


@dataclass(frozen=True)
class Example:
    prompt: str | list  # as the dataset has it (string or messages): what reward functions get as `prompt(s)`
    fields: dict = field(default_factory=dict)  # passed to the reward functions as keyword arguments
    prompt_ids: list = field(default_factory=list)  # the rendered prompt's token ids: what the engine receives
    prompt_text: str = ""  # the rendered prompt, for display (`raygrpo data`)
    where: str = field(default="", compare=False)  # file and line/row it came from, for error messages


# --------------------------------------------------------------------------- sources


def examples_from_rows(rows: list[tuple[str, dict]], prompt_key: str, problems: list[str]) -> list[Example]:
    """Rows -> examples; every bad row is named (file and line/row) in one error, with `problems`
    the reader found."""
    out = []
    for where, row in rows:
        if prompt_key not in row:
            problems.append(f"{where}: no {prompt_key!r} column (columns: {', '.join(row) or 'none'}); "
                            "set data.prompt_key to the prompt's column")
            continue
        problem = prompt_problem(row[prompt_key])
        if problem:
            problems.append(f"{where}: {problem}")
            continue
        # content lists of text parts become strings here, once: templates, rewards and logs see one form
        out.append(Example(text_content(row[prompt_key]), {k: v for k, v in row.items() if k != prompt_key}, where=where))
    raise_problems(problems, "malformed dataset rows")
    return out


def load_examples(spec: str, prompt_key: str = "prompt", split: str = "train") -> list[Example]:
    problems: list[str] = []
    examples = examples_from_rows(read_rows(spec, split, problems), prompt_key, problems)
    if not examples:
        raise DataError(f"{spec} holds no examples")
    return examples


def load_jsonl(path: str | Path) -> list[Example]:
    """One JSON object per line with a `prompt` (kept for callers that read JSONL directly)."""
    return load_examples(str(path))


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


def load_splits(train: str, eval_path: str, num_eval: int, digits: int, seed: int, prompt_key: str = "prompt",
                cap_eval: bool = True) -> tuple[list[Example], list[Example]]:
    """(train examples, held-out examples), not rendered. A task's held-out split is disjoint from its
    train split. `cap_eval=False` keeps the whole eval file (the caller caps it after filtering)."""
    cap = num_eval if cap_eval else None
    held_file = load_examples(eval_path, prompt_key, "eval")[:cap] if eval_path else []
    if train.startswith("task:"):
        examples = arithmetic_examples(train.split(":", 1)[1], digits)
        random.Random(f"heldout-{seed}").shuffle(examples)
        held, rest = examples[:num_eval], examples[num_eval:]
        return rest, (held_file if eval_path else held)
    return load_examples(train, prompt_key, "train"), held_file


# --------------------------------------------------------------------------- rendering for the model


def load_tokenizer(model_path: str):
    """The model's tokenizer, checked: it loads, has a vocabulary and turns text into tokens (a model dir
    without tokenizer files otherwise "trains" on 0-token prompts)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise DataError(f"model.path {model_path}: its tokenizer does not load ({type(e).__name__}: {e}); the "
                        "tokenizer files (tokenizer.json / tokenizer_config.json ...) belong in the model dir") from None
    problems = tokenizer_problems(tok, model_path)
    if problems:
        raise DataError("; ".join(problems))
    return tok


# The roles chat templates know. Another one ("wizard") is rendered by some templates as it is, dropped
# or refused by others: warned about at load, not refused (a template may define its own).
KNOWN_ROLES = ("system", "user", "assistant", "tool", "developer")


def unknown_roles_note(examples: list[Example], name: str) -> str | None:
    odd = [(e, m["role"]) for e in examples if isinstance(e.prompt, list) for m in e.prompt
           if m["role"] not in KNOWN_ROLES]
    if not odd:
        return None
    roles = sorted({r for _, r in odd})
    return (f"warning: {len({id(e) for e, _ in odd})} {name} prompt(s) have messages with a role chat templates "
            f"do not know ({', '.join(map(repr, roles))}; known: {', '.join(KNOWN_ROLES)}), e.g. {odd[0][0].where}: "
            "the model's template may render, drop or refuse them. Check `raygrpo data`'s rendered prompts")


@dataclass
class RunData:
    train: list[Example]
    heldout: list[Example]
    reports: list[LengthReport]  # train (and eval): rows, filtered, prompt-token stats
    warnings: list[str] = field(default_factory=list)  # what looks wrong in the data but is not refused

    def notes(self) -> list[str]:
        """The once-per-run lines about filtered prompts and odd data."""
        return [n for n in (r.filtered_note() for r in self.reports) if n] + self.warnings


# What the scorer passes to every reward function besides the dataset's columns (actors/rewards/scorer.py).
SCORER_KEYWORDS = frozenset({"prompt", "completion", "prompts", "completions", "completion_ids", "_num_tokens",
                             "_finish_reason", "_max_new_tokens", "_overlong_buffer", "_answer_key", "_messages",
                             "_turns"})


def required_columns(spec: str) -> list[str]:
    """The parameters without a default of the user reward function `spec` (path/to/file.py:name) that the
    scorer does not pass itself: each must be a column of every row. Read from the file's source, so the
    driver runs no user code; [] where `name` is not a plain `def` at the file's top level."""
    path, _, name = spec.rpartition(":")
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return []  # a file that does not load is the reward pool's to report, at start
    found = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]
    if not found:
        return []
    a = found[-1].args  # the last definition is the one Python keeps
    positional = a.posonlyargs + a.args
    required = positional[:len(positional) - len(a.defaults)]
    if required and required[0].arg not in ("prompts", "completions"):
        required = required[2:]  # a per-sample function gets (prompt, completion) by position
    required += [k for k, default in zip(a.kwonlyargs, a.kw_defaults) if default is None]
    return [p.arg for p in required if p.arg not in SCORER_KEYWORDS]


def reward_column_problem(cfg, data: RunData) -> str | None:
    """What reward.functions would fail on at step 1, said at load: the answer checkers (gsm8k,
    math_verify, exact_match) compare against the column reward.answer_key, and a user function's
    parameter without a default (required_columns) needs its column in every row. The held-out rows
    count for a user function only where the evaluation scores with it (no answer checker configured)."""
    checkers = [f for f in cfg.reward.functions if f in ANSWER_CHECKERS]
    key = cfg.reward.answer_key
    for name, rows in (("train", data.train), ("eval", data.heldout)):
        missing = [e for e in rows if e.fields.get(key) is None]
        if checkers and missing:
            return (f"{len(missing)} of {len(rows)} {name} rows have no {key!r} column (reward.answer_key), which "
                    f"{', '.join(checkers)} compare(s) against; e.g. {missing[0].where or 'a row'}: columns "
                    f"{', '.join(missing[0].fields) or 'none'}. Set reward.answer_key to the answer's column, or "
                    "choose reward functions that need no answer")
    scored = [("train", data.train)] + ([] if checkers else [("eval", data.heldout)])
    for spec in (f for f in cfg.reward.functions if is_file_spec(f)):
        for column in required_columns(spec):
            for name, rows in scored:
                missing = [e for e in rows if column not in e.fields]
                if missing:
                    return (f"reward function {spec} takes {column!r} (a parameter without a default), a column "
                            f"{len(missing)} of {len(rows)} {name} rows lack; e.g. {missing[0].where or 'a row'}: "
                            f"columns {', '.join(missing[0].fields) or 'none'}. Add the column to the data, give the "
                            "parameter a default, or rename it to a column the data has")
    return None


def prompt_token_limit(cfg) -> int:
    """data.max_prompt_tokens, or what rollout.max_model_len - rollout.max_new_tokens leaves."""
    return cfg.data.max_prompt_tokens or cfg.rollout.max_model_len - cfg.rollout.max_new_tokens


def render_examples(examples: list[Example], tokenizer, fmt: PromptFormat) -> list[Example]:
    rendered = render([e.prompt for e in examples], tokenizer, fmt)
    return [Example(e.prompt, e.fields, ids, text, e.where) for e, (text, ids) in zip(examples, rendered)]


def load_run_data(cfg, tokenizer) -> RunData:
    """The run's data exactly as training uses it (`cfg` is a RunConfig): loaded, rendered with the
    model's chat template, prompts too long for the engine filtered (or an error), the eval set
    capped at data.num_eval after filtering. Fails before any actor starts."""
    d = cfg.data
    fmt = PromptFormat(d.apply_chat_template, d.system_prompt, dict(d.chat_template_kwargs))
    limit = prompt_token_limit(cfg)
    train, held = load_splits(d.train, d.eval, d.num_eval, d.task_digits, cfg.trainer.seed, d.prompt_key, cap_eval=False)
    out, reports = [], []
    for name, examples, source in (("train", train, d.train), ("eval", held, d.eval or d.train)):
        if not examples:
            out.append([])
            continue
        rendered = render_examples(examples, tokenizer, fmt)
        kept, report = length_filter(rendered, [len(e.prompt_ids) for e in rendered], limit, d.long_prompts, name,
                                     [e.where or f"{source} example {i}" for i, e in enumerate(rendered)])
        if not kept:
            raise DataError(
                f"every {name} prompt of {source} ({report.rows}) is longer than {limit} tokens "
                f"(shortest {min(report.tokens)}), so nothing is left to train on; raise rollout.max_model_len or "
                "data.max_prompt_tokens, or lower rollout.max_new_tokens")
        out.append(kept if name == "train" else kept[:d.num_eval])
        reports.append(report)
    warnings = [w for w in (unknown_roles_note(out[0], "train"), unknown_roles_note(out[1], "eval")) if w]
    return RunData(out[0], out[1], reports, warnings)


# --------------------------------------------------------------------------- order


class PromptStream:
    """Examples in a per-epoch permutation of (seed, epoch); `state()` is the resume position.

    trainer.mode=pipeline takes prompts ahead of training: a checkpoint records the ones taken and not yet
    trained on ("in_flight", indices into the examples, in the order they were taken), and a stream loaded
    from it hands those out first, then goes on from its position."""

    def __init__(self, examples: list[Example], seed: int):
        if not examples:
            raise DataError("the training set is empty")
        self.examples, self.seed = examples, seed
        self.epoch, self.index = 0, 0
        self._order = self._permutation(0)
        self._first: collections.deque[int] = collections.deque()  # a checkpoint's in_flight, not yet taken again
        self._index_of = {id(e): i for i, e in enumerate(examples)}

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        random.Random(f"{self.seed}-{epoch}").shuffle(order)
        return order

    def take(self, n: int) -> list[Example]:
        out = []
        while len(out) < n and self._first:
            out.append(self.examples[self._first.popleft()])
        while len(out) < n:
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            out.append(self.examples[self._order[self.index]])
            self.index += 1
        return out

    def state(self, in_flight: Sequence[Example] = ()) -> dict:
        """The position; `in_flight`: examples taken from this stream and not trained on (handed out first
        after a resume, before what a loaded checkpoint's in_flight still holds; the key only when any)."""
        first = [self._index_of[id(e)] for e in in_flight] + list(self._first)
        return {"epoch": self.epoch, "index": self.index, **({"in_flight": first} if first else {})}

    def load_state(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation(self.epoch)
        first = [int(i) for i in state.get("in_flight", [])]
        bad = [i for i in first if not 0 <= i < len(self.examples)]
        if bad:
            raise DataError(f"the checkpoint's data position names prompts {bad[:5]} in flight, but the training set "
                            f"has {len(self.examples)}: resume with the data the run was started with")
        self._first = collections.deque(first)
