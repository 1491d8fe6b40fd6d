"""`raygrpo bench --parts code` (cluster/bench/code.py): code rewards' programs/s through the sandbox on the
recipe's data and on 1 s programs, written to the bench JSON, with nothing else started (no model, no Ray)."""
from __future__ import annotations

import json

import pytest

from actors.runtime.sandbox import probe
from cluster import cli
from cluster.bench import code as code_part

NO_STRICT = probe("strict")  # why the strict level cannot be had here (None: it can)
pytestmark = pytest.mark.skipif(NO_STRICT is not None, reason=f"no strict sandbox here: {NO_STRICT}")


def test_the_code_part_alone_measures_programs_per_second_and_starts_nothing_else(tmp_path, monkeypatch):
    monkeypatch.setattr(code_part, "WORKERS", (1, 2))
    monkeypatch.setattr(code_part, "STEP_PROGRAMS", 4)
    monkeypatch.setattr(code_part, "SLOW_PROGRAMS", 2)
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--parts", "code", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert "model" not in res and "schedules" not in res  # no model built, no training run
    code = res["code"]
    assert code["level"] == "strict" and set(code["recipe"]) == set(code["slow"]) == {"1", "2"}
    assert all(r["programs"] == 4 and r["programs_per_s"] > 0 for r in code["recipe"].values())
    # a 1 s program: one worker scores at most one a second, two at most two
    assert code["slow"]["1"]["programs_per_s"] <= 1.0 and code["slow"]["2"]["programs_per_s"] <= 2.0
    assert code["step_s"]["1"] == code["recipe"]["1"]["seconds"]


def test_the_recipe_set_mixes_right_and_wrong_programs():
    prompts, texts, rows = code_part.recipe_set(4)
    assert len(prompts) == len(texts) == len(rows) == 4
    assert texts[0] != texts[1] and all(r["test_list"] for r in rows)
