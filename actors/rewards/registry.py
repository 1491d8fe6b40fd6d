"""The one table of reward kinds (name -> RewardKind), and what the rest of the code asks of it.

    exact_match, gsm8k, ...        a built-in (functions.py)                      python.py
    path/to/file.py:function       user code, run in isolated processes (pool.py)  python.py
    model:PATH                     a reward model: a HF AutoModelForSequenceClassification directory
                                   with one label, scored by a RewardModelActor     model.py
    http://... or https://...      a remote verifier                               http.py
    code_tests                     programs run against the row's tests, sandboxed  code.py

Adding a kind: one module with a `RewardKind` (base.py) and one line in KINDS. The scorer
(scorer.py), the config check, the metric names and the driver (which actors to start) all ask
here; nothing else dispatches on an entry's text.

A function's name (metrics `rewards/<name>/...`) is the kind's default (the built-in's name, a
Python function's `__name__`, the reward model directory's basename, or the URL's host and path with
"/" as "_");
`reward.names` overrides them. Names keep the characters TensorBoard accepts in a tag.

Light on purpose (no torch, no Ray): the driver checks a config before anything heavy starts.
"""
from __future__ import annotations

from actors.rewards.base import RewardKind, safe_name
from actors.rewards.code import CodeKind
from actors.rewards.http import HttpKind
from actors.rewards.model import ModelKind
from actors.rewards.python import PythonKind

# The order matters twice. An entry is of the first kind that recognises it (`model:a.py:f` is a reward
# model, not user code). And a batch is sent to the kinds in this order, then waited for in it: the
# verifiers and reward models get their work first, then the Python functions are scored on the caller's
# thread and processes while the others work (python last).
KINDS: dict[str, RewardKind] = {k.name: k for k in (HttpKind(), ModelKind(), CodeKind(), PythonKind())}


def kind_for(spec: str) -> RewardKind | None:
    """The kind of one `reward.functions` entry; None when no kind recognises it."""
    return next((k for k in KINDS.values() if k.recognises(spec)), None)


def resolve(spec: str) -> str:
    """An entry as it crosses into another process: a file or model path made absolute."""
    kind = kind_for(spec)
    return kind.resolve(spec) if kind else spec


def default_name(spec: str, loaded: dict[str, str] | None = None) -> str:
    """The metric name of an entry. `loaded`: spec -> the name its code gives itself (a Python function's __name__)."""
    kind = kind_for(spec)
    return kind.default_name(spec, loaded or {}) if kind else safe_name(spec)


def spec_problems(spec: str) -> list[str]:
    """What is wrong with one entry, found without starting anything."""
    kind = kind_for(spec)
    if kind is None:
        forms = [k.form for k in reversed(KINDS.values())]  # the most general kind's first
        return [f"unknown reward function {spec!r}; " + ", ".join(forms[:-1]) + f", or {forms[-1]}"]
    return kind.problems(spec)

