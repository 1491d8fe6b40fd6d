"""The planted-bug table (tests/planted_bugs.py) checked without planting anything: every row's snippet occurs
exactly once in its file of this tree, so a refactor cannot leave a row that plants nothing, and every test node
it names exists (collected, not run: the planted runs take minutes, `tests/planted_bugs.py` runs them)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.planted_bugs import BUGS, GUARD, GUARD_EXIT, PlantError, plant

ROOT = Path(__file__).resolve().parents[2]


def test_the_table_has_the_issues_bugs_and_more_each_named_once():
    assert len(BUGS) >= 8 and len({b.name for b in BUGS}) == len(BUGS)
    assert all(b.tests and b.suffers and b.snippet != b.replacement for b in BUGS)


@pytest.mark.parametrize("bug", BUGS, ids=[b.name for b in BUGS])
def test_every_snippet_occurs_exactly_once_in_its_file(bug):
    assert (ROOT / bug.file).read_text().count(bug.snippet) == 1, f"{bug.name}: re-point its snippet in {bug.file}"


def test_planting_refuses_a_snippet_not_found_exactly_once(tmp_path):
    (tmp_path / "m.py").write_text("x = 1\nx = 1\ny = 2\n")
    row = BUGS[0]
    with pytest.raises(PlantError, match="occurs 2 times"):
        plant(tmp_path, type(row)(**{**row.__dict__, "file": "m.py", "snippet": "x = 1\n"}))
    with pytest.raises(PlantError, match="occurs 0 times"):
        plant(tmp_path, type(row)(**{**row.__dict__, "file": "m.py", "snippet": "z = 3\n"}))
    plant(tmp_path, type(row)(**{**row.__dict__, "file": "m.py", "snippet": "y = 2\n", "replacement": "y = 3\n"}))
    assert (tmp_path / "m.py").read_text() == "x = 1\nx = 1\ny = 3\n"


def test_every_named_test_node_is_collected():
    nodes = sorted({n for b in BUGS for n in b.tests})
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", "-o", "addopts=", *nodes], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    collected = done.stdout.splitlines()
    missing = [n for n in nodes if not any(c == n or c.startswith(n + "[") or c.startswith(n + "::") for c in collected)]
    assert not missing, f"named by tests/planted_bugs.py but not collected: {missing}"


def test_the_guard_stops_a_run_that_imports_the_package_from_elsewhere(tmp_path):
    """The planted copy's guard: here the packages come from the checkout, not from `tmp_path`, so it must stop
    the run (a planted run importing the checkout's code would pass and report the bug MISSED)."""
    (tmp_path / "_planted_guard.py").write_text(GUARD)
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "_planted_guard", "-p", "no:cacheprovider", "-q",
                           "--collect-only", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path), "PLANTED_COPY": str(tmp_path)})
    assert done.returncode == GUARD_EXIT and "not from the copy" in done.stdout + done.stderr, done.stdout + done.stderr
