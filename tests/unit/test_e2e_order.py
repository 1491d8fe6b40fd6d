"""The order `make test` hands the e2e files to its workers (tests/conftest.py): the slowest first, as the last
recorded e2e tier measured them, so that no long file starts last and keeps one worker busy alone."""
from __future__ import annotations

import json

from tests.conftest import SLOWEST_FIRST, slowest_first


def cost_file(tmp_path, files: list[dict], tier: str = "e2e"):
    path = tmp_path / "suite-costs.json"
    path.write_text(json.dumps({"tiers": {tier: {"files": files}}}))
    return path


def test_the_order_is_the_recorded_seconds_slowest_first(tmp_path):
    path = cost_file(tmp_path, [{"file": "tests/e2e/test_quick.py", "test_s": 3.0},
                                {"file": "tests/e2e/test_slow.py", "test_s": 300.5},
                                {"file": "tests/docker/test_image.py", "test_s": 900.0},  # not an e2e file
                                {"file": "tests/e2e/test_middle.py", "test_s": 40.0}])
    order = slowest_first(path)
    assert order[:3] == ("test_slow.py", "test_middle.py", "test_quick.py")
    assert "test_image.py" not in order
    # the fallback's files that the record lacks (a run of a few files records only those) come after
    assert order[3:] == SLOWEST_FIRST


def test_a_file_the_record_holds_is_placed_by_it_not_by_the_fallback(tmp_path):
    last = SLOWEST_FIRST[-1]
    order = slowest_first(cost_file(tmp_path, [{"file": f"tests/e2e/{last}", "test_s": 1000.0}]))
    assert order[0] == last and order.count(last) == 1


def test_without_a_readable_record_the_fallback_list(tmp_path):
    assert slowest_first(tmp_path / "absent.json") == SLOWEST_FIRST
    (tmp_path / "bad.json").write_text("{not json")
    assert slowest_first(tmp_path / "bad.json") == SLOWEST_FIRST
    assert slowest_first(cost_file(tmp_path, [{"file": "tests/unit/test_x.py", "test_s": 1.0}], tier="unit")) == SLOWEST_FIRST
