"""The code's size limits (issue 60), read from the source with the AST:

- no function in cluster/ (bench/ included) is over 80 lines (end_lineno - lineno + 1: the def line to its
  last line, its decorators left out; methods and nested functions count on their own, and a nested one's
  lines count in the function around it too);
- no file in cluster/, actors/ or learner/ is over 500 lines. The largest when the limit was set: cluster/config.py
  467, cluster/cli.py 465, cluster/run/metrics.py 465 (actors/rollout.py had 490 before it was split by concern):
  the limit holds with little room, so a file that grows past it is split by concern, not the bound raised.

A self-test runs each check on a file made here that breaks it, so neither check passes by finding nothing.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 500


def long_functions(folder: Path, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """'path:line name' -> lines, for every function or method under `folder` longer than `limit`."""
    over = {}
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    over[f"{path.relative_to(folder.parent)}:{node.lineno} {node.name}"] = lines
    return over


def long_files(folder: Path, limit: int = MAX_FILE_LINES) -> dict[str, int]:
    """path -> lines, for every Python file under `folder` longer than `limit`."""
    counts = {str(p.relative_to(folder.parent)): len(p.read_text().splitlines()) for p in sorted(folder.rglob("*.py"))}
    return {path: n for path, n in counts.items() if n > limit}


def test_no_function_in_cluster_is_over_80_lines():
    assert (ROOT / "cluster" / "bench" / "command.py").exists()  # the scan reads the tree it means to
    over = long_functions(ROOT / "cluster")
    assert not over, (f"functions over {MAX_FUNCTION_LINES} lines in cluster/ (split each into named parts that say "
                      f"what they are, e.g. one per command, per part, per actor kind): {over}")


@pytest.mark.parametrize("folder", ["cluster", "actors", "learner"])
def test_no_file_is_over_500_lines(folder):
    assert any((ROOT / folder).rglob("*.py"))
    over = long_files(ROOT / folder)
    assert not over, f"files over {MAX_FILE_LINES} lines in {folder}/ (split them by concern): {over}"


def test_the_checks_find_what_breaks_them(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "".join(f"        x{i} = {i}\n" for i in range(80))  # a method: 8 spaces in
    (pkg / "long.py").write_text(f"def short():\n    pass\n\n\nclass A:\n    @property\n    def long(self):\n{body}")
    (pkg / "ok.py").write_text("def f():\n" + "".join(f"    y{i} = {i}\n" for i in range(79)))  # 80 lines: allowed
    assert long_functions(pkg) == {"pkg/long.py:7 long": 81}
    assert long_files(pkg, limit=85) == {"pkg/long.py": 87}
    assert long_files(pkg) == {}
