"""User code named in a config as `path/to/file.py:name` (reward functions, environments): telling
such a spec from others, and loading it. Written once, for every kind of user code.

Deliberately light: no torch import (the isolated processes that run user code load it).
"""
from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Callable


def is_file_spec(spec: str) -> bool:
    """`path/to/file.py:name`: a Python file and, after the last colon, a name in it."""
    path, sep, name = spec.rpartition(":")
    return bool(sep and path.endswith(".py") and name)


def load_file_function(spec: str) -> Callable:
    """`path/to/file.py:function_name` -> the function (imports the file as a module)."""
    path, _, name = spec.rpartition(":")
    module_name = "raygrpo_user_reward_" + re.sub(r"\W", "_", os.path.abspath(path))
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(f"{path} has no function {name!r} (it defines: {', '.join(defined) or 'nothing'})")
    return fn
