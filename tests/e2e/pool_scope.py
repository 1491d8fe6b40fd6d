"""Under `make test` (pytest-xdist, --dist loadfile: each file a unit of work, fixtures of a module built once), the
files that use the engine pool (tests/e2e/engine_pool.py, the `engine_pool` fixture) are ONE unit of work, so one
xdist worker runs all of them and the pool's engines start once per suite; as files each, they went to both
workers, and each worker started its own pool (the 2 tiny-model engines twice in session 21's full run).

The unit goes out where the first of its files stands in the collection order (tests/conftest.py: the slowest
files first), its files' tests in that order, each file's tests together; every other file stays a unit of its own.
A file uses the pool when one of its functions takes `engine_pool` as an argument (a test or a fixture).
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

from xdist.scheduler import LoadFileScheduling

POOL_SCOPE = "tests/e2e: the files that use the engine pool"


@functools.cache
def uses_the_pool(path: str) -> bool:
    """Whether a function of the file at `path` takes the `engine_pool` fixture."""
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return False
    return any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
               and "engine_pool" in {a.arg for a in node.args.args + node.args.kwonlyargs}
               for node in ast.walk(tree))


def scope(file: str, rootdir: Path) -> str:
    """The unit of work of a test file (its path relative to `rootdir`, as in a node id)."""
    return POOL_SCOPE if uses_the_pool(str(rootdir / file)) else file


class PoolFilesTogether(LoadFileScheduling):
    """--dist loadfile, except that the files using the engine pool are one unit of work."""

    def __init__(self, config, log=None):
        super().__init__(config, log)
        self.rootdir = Path(config.rootpath)

    def _split_scope(self, nodeid: str) -> str:
        return scope(super()._split_scope(nodeid), self.rootdir)
