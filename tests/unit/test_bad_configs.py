"""The bad-config table (docs/config-errors.md): each of the cases in tests/bad_configs.py is refused, and
its problems name the config keys it got wrong and the key to write instead where there is one."""
import re
from pathlib import Path

import pytest
from bad_configs import CASES, cell, check, named_keys

ROOT = Path(__file__).resolve().parents[2]


def names(problems: list[str], key: str) -> bool:
    return any(re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", p) for p in problems)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_bad_config_is_refused_naming_its_keys(case, tmp_path):
    problems = check(case, tmp_path)
    assert problems, f"{case.name}: the config check accepted it"
    for key in case.keys:
        assert names(problems, key), f"{case.name}: no problem names {key}: {problems}"
    offered = [p for p in problems if "did you mean" in p or "raygrpo calls it" in p]
    for key in case.did_you_mean:
        assert names(offered, key), f"{case.name}: {key} is not offered: {problems}"


def test_every_problem_comes_at_once_one_line_each(tmp_path):
    (case,) = [c for c in CASES if c.name == "five problems at once"]
    problems = check(case, tmp_path)
    assert len(problems) == 5, problems
    assert set(case.keys) <= set(named_keys(problems))


def test_the_table_covers_about_thirty_kinds_of_mistake():
    assert len(CASES) >= 30 and len({c.name for c in CASES}) == len(CASES)
    assert sum(bool(c.did_you_mean) for c in CASES) >= 8  # did-you-mean and TRL / verl names
    assert sum(any("=" in o for o in c.overrides) for c in CASES) >= 20 and sum(c.yaml is not None for c in CASES) >= 8


def test_the_doc_says_what_the_check_says_today(tmp_path):
    """docs/config-errors.md's table: a row per case, whose last cell is what the check prints now
    (`.venv/bin/python tests/bad_configs.py` prints it again)."""
    rows = {line.split(" | ")[1]: line for line in (ROOT / "docs" / "config-errors.md").read_text().splitlines()
            if re.match(r"\| \d+ \| ", line)}
    assert list(rows) == [c.name for c in CASES]
    for case in CASES:
        assert rows[case.name].endswith(f" | {cell(check(case, tmp_path))} |"), case.name
