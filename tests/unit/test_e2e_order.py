"""The order `make test` hands the e2e files to its workers (tests/conftest.py): each heavy file (one with a test of
HEAVY_TEST_S or more) followed by light files worth its seconds, so that the other worker runs those beside it and
two heavy files never run at once; otherwise the slowest first, so that no long file starts last and keeps one
worker busy alone. The seconds are the last recorded e2e tier's, or RECORDED's in a fresh clone."""
from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import HEAVY_TEST_S, RECORDED, e2e_order, recorded_files

E2E = Path(__file__).resolve().parent.parent / "e2e"


def cost_file(tmp_path, tests: list[tuple[str, float]], tier: str = "e2e"):
    path = tmp_path / "suite-costs.json"
    path.write_text(json.dumps({"tiers": {tier: {"tests": [{"nodeid": n, "duration_s": s} for n, s in tests]}}}))
    return path


def test_each_heavy_file_is_followed_by_light_files_worth_its_seconds():
    files = {"a.py": (300.0, 150.0), "b.py": (200.0, 100.0), "c.py": (150.0, 50.0), "d.py": (100.0, 40.0),
             "e.py": (60.0, 60.0), "f.py": (30.0, 10.0), "g.py": (10.0, 10.0)}
    assert e2e_order(files, heavy_test_s=90.0) == ("a.py", "c.py", "d.py", "e.py", "b.py", "f.py", "g.py")
    # without heavy files: the slowest first
    assert e2e_order(files, heavy_test_s=1000.0) == ("a.py", "b.py", "c.py", "d.py", "e.py", "f.py", "g.py")


def test_the_record_gives_each_files_seconds_and_longest_test(tmp_path):
    path = cost_file(tmp_path, [("tests/e2e/test_slow.py::test_1", 130.0), ("tests/e2e/test_slow.py::test_2", 20.0),
                                ("tests/e2e/test_quick.py::test_1", 3.0),
                                ("tests/docker/test_image.py::test_1", 900.0)])  # not an e2e file
    files = recorded_files(path)
    assert (files["test_slow.py"], files["test_quick.py"]) == ((150.0, 130.0), (3.0, 3.0))
    assert "test_image.py" not in files
    # the fallback's files that the record lacks (a run of a few files records only those) keep their seconds
    assert {name: files[name] for name in RECORDED if name not in ("test_slow.py", "test_quick.py")} == RECORDED


def test_without_a_readable_record_the_recorded_seconds(tmp_path):
    assert recorded_files(tmp_path / "absent.json") == RECORDED
    (tmp_path / "bad.json").write_text("{not json")
    assert recorded_files(tmp_path / "bad.json") == RECORDED
    assert recorded_files(cost_file(tmp_path, [("tests/unit/test_x.py::test_1", 1.0)], tier="unit")) == RECORDED


def test_a_fresh_clone_orders_every_e2e_file_and_runs_no_two_heavy_files_at_once():
    """RECORDED holds every e2e file (a new one missing from it would go last in a fresh clone, however heavy), and
    its order puts light files worth each heavy file's seconds after it."""
    assert set(RECORDED) == {p.name for p in E2E.glob("test_*.py")}
    order = e2e_order(RECORDED)
    heavy = [i for i, name in enumerate(order) if RECORDED[name][1] >= HEAVY_TEST_S]
    assert len(heavy) >= 4
    for i, j in zip(heavy, heavy[1:]):
        assert sum(RECORDED[name][0] for name in order[i + 1:j]) >= RECORDED[order[i]][0], order[i:j + 1]
