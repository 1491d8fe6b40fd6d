"""The kinds of `reward.functions` entry, their default names, and what is checked at start.

    exact_match, gsm8k, ...        a built-in (actors/reward_functions.py)
    path/to/file.py:function       user code, run in isolated processes (actors/reward_pool.py)
    model:PATH                     a reward model: a HF AutoModelForSequenceClassification directory
                                   with one label, scored by a RewardModelActor (actors/reward_model.py)
    http://... or https://...      a remote verifier (actors/reward_http.py)

A function's name (metrics `rewards/<name>/...`) is the built-in's name, a Python function's
`__name__`, the reward model directory's basename, or the URL's host and path; `reward.names`
overrides them. Names keep the characters TensorBoard accepts in a tag ([A-Za-z0-9_.-/]).

Light on purpose (json and os only): the driver checks a config before anything heavy starts.
"""
from __future__ import annotations

import json
import os
import re
from urllib.parse import urlsplit

from actors.reward_functions import REWARDS

MODEL_PREFIX = "model:"
_TAG_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-/]")


def kind_of(spec: str) -> str:
    """builtin | file | model | http | unknown."""
    if spec in REWARDS:
        return "builtin"
    if spec.startswith(MODEL_PREFIX):
        return "model"
    if spec.startswith(("http://", "https://")):
        return "http"
    path, sep, fn = spec.rpartition(":")
    if sep and path.endswith(".py") and fn:
        return "file"
    return "unknown"


def model_path(spec: str) -> str:
    return spec[len(MODEL_PREFIX):]


def safe_name(name: str) -> str:
    return _TAG_UNSAFE.sub("_", name).strip("/") or "reward"


def default_name(spec: str, function_names: dict[str, str] | None = None) -> str:
    """The metric name of an entry. `function_names`: spec -> __name__, from the worker processes."""
    kind = kind_of(spec)
    if kind == "model":
        return safe_name(os.path.basename(os.path.normpath(model_path(spec))))
    if kind == "http":
        u = urlsplit(spec)
        return safe_name(f"{u.hostname or ''}{u.path.rstrip('/')}")
    if kind == "file":
        return safe_name((function_names or {}).get(spec) or spec.rpartition(":")[2])
    return safe_name(spec)


def resolve(spec: str) -> str:
    """An entry as it crosses into another process: a file or model path made absolute."""
    kind = kind_of(spec)
    if kind == "model":
        return MODEL_PREFIX + os.path.abspath(model_path(spec))
    if kind == "file":
        path, _, fn = spec.rpartition(":")
        return f"{os.path.abspath(path)}:{fn}"
    return spec


def spec_problems(spec: str) -> list[str]:
    """What is wrong with one entry, found without starting anything."""
    kind = kind_of(spec)
    if kind == "unknown":
        return [f"unknown reward function {spec!r}; registered: {', '.join(sorted(REWARDS))}, or user code as "
                "'path/to/file.py:function_name', a reward model as 'model:PATH', or a verifier URL 'http(s)://...'"]
    if kind == "file":
        path = spec.rpartition(":")[0]
        if not os.path.isfile(path):
            return [f"reward function file not found: {path} (from {spec!r}, cwd {os.getcwd()})"]
    if kind == "model":
        return model_dir_problems(model_path(spec))
    if kind == "http":
        u = urlsplit(spec)
        if not u.hostname:
            return [f"reward verifier URL {spec!r} has no host (expected http://HOST[:PORT]/PATH)"]
        try:
            u.port  # noqa: B018 - raises on a bad port
        except ValueError as e:
            return [f"reward verifier URL {spec!r}: {e}"]
    return []


def model_dir_problems(path: str) -> list[str]:
    """A reward model directory: a HF sequence-classification model with one label, and a tokenizer."""
    where = f"reward model {path!r} (reward.functions entry model:{path})"
    if not os.path.isdir(path):
        return [f"{where}: no such directory (cwd {os.getcwd()})"]
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        return [f"{where}: cannot read config.json ({e}); expected a directory written by save_pretrained"]
    problems = []
    archs = config.get("architectures") or []
    if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
        problems.append(f"{where} is a {', '.join(archs)}, not a ...ForSequenceClassification model "
                        "(AutoModelForSequenceClassification with num_labels=1)")
    labels = len(config["id2label"]) if isinstance(config.get("id2label"), dict) else config.get("num_labels", 2)
    if labels != 1:
        problems.append(f"{where} has {labels} labels; a reward model has one (num_labels=1): its single logit is the reward")
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json",
                                                                "tokenizer.model", "vocab.json")):
        problems.append(f"{where} has no tokenizer files: save the reward model's tokenizer into the same directory")
    return problems


def has_chat_template(path: str) -> bool:
    """Whether the model directory's tokenizer carries a chat template (config or chat_template.jinja)."""
    if os.path.isfile(os.path.join(path, "chat_template.jinja")) or os.path.isfile(os.path.join(path, "chat_template.json")):
        return True
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            return bool(json.load(f).get("chat_template"))
    except (OSError, ValueError):
        return False
