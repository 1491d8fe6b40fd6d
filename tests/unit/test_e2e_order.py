"""The order `make test` hands the e2e files to its workers (tests/conftest.py): each heavy file (one with a test of
HEAVY_TEST_S or more) followed by light files worth its seconds, so that the other worker runs those beside it and
the two heaviest do not start side by side; otherwise the slowest first, so that no long file starts last and keeps
one worker busy alone. The seconds are RECORDED's, one whole e2e tier's."""
from __future__ import annotations

from pathlib import Path

from tests.conftest import HEAVY_TEST_S, RECORDED, e2e_order

E2E = Path(__file__).resolve().parent.parent / "e2e"


def test_each_heavy_file_is_followed_by_light_files_worth_its_seconds():
    files = {"a.py": (300.0, 150.0), "b.py": (200.0, 100.0), "c.py": (150.0, 50.0), "d.py": (100.0, 40.0),
             "e.py": (60.0, 60.0), "f.py": (30.0, 10.0), "g.py": (10.0, 10.0)}
    assert e2e_order(files, heavy_test_s=90.0) == ("a.py", "c.py", "d.py", "e.py", "b.py", "f.py", "g.py")
    # without heavy files: the slowest first
    assert e2e_order(files, heavy_test_s=1000.0) == ("a.py", "b.py", "c.py", "d.py", "e.py", "f.py", "g.py")


def test_every_e2e_file_has_its_seconds_and_each_heavy_file_light_files_beside_it():
    """RECORDED holds every e2e file (a new one missing from it would go last, however heavy), and its order puts
    light files worth each heavy file's seconds after it, but for the last heavy file where the light ones run out."""
    assert set(RECORDED) == {p.name for p in E2E.glob("test_*.py")}
    order = e2e_order(RECORDED)
    heavy = [i for i, name in enumerate(order) if RECORDED[name][1] >= HEAVY_TEST_S]
    assert len(heavy) >= 4
    for i, j in zip(heavy, heavy[1:]):  # every heavy file but the last is followed by its light ones
        assert sum(RECORDED[name][0] for name in order[i + 1:j]) >= RECORDED[order[i]][0], order[i:j + 1]
