"""The suite's cost file (tests/suite_costs.py): the ledger lines each start point writes, how a test's starts
are read from its process's ledger, how reports from xdist workers are merged, and the file and table written.

The plugin itself runs in inner pytest sessions (one process, and two xdist workers) on tests that record
starts as the real start points do, directly and from a subprocess, as `raygrpo` CLI runs and Ray actors
do; the real start points are called with what they start faked (vLLM, DeepSpeed, Ray), so that the
line they write is checked without starting anything."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
from suite_costs import CostsByTest, LedgerReader, count_starts, main, render, tier_summary, update_cost_file

from actors.config import RolloutConfig
from actors.rollout import RolloutWorker
from actors.runtime import start_ledger
from actors.runtime.start_ledger import LEDGER_ENV, record_start
from cluster.launch import ray_cluster
from learner import worker
from learner.config import AlgoConfig, LearnerConfig

TESTS = Path(__file__).resolve().parent.parent


def ledger_lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_record_start_writes_a_line_only_where_the_ledger_is_named(tmp_path, monkeypatch):
    ledger = tmp_path / "ledger.jsonl"
    monkeypatch.delenv(LEDGER_ENV, raising=False)
    record_start("engine", worker_index=0)  # a user's run: nothing written anywhere
    assert not ledger.exists()
    monkeypatch.setenv(LEDGER_ENV, str(ledger))
    record_start("engine", worker_index=3)
    record_start("ray_cluster", how="embedded")
    lines = ledger_lines(ledger)
    assert [(x["kind"], x.get("worker_index"), x.get("how")) for x in lines] == [("engine", 3, None),
                                                                                ("ray_cluster", None, "embedded")]
    with pytest.raises(ValueError, match="'engines' is none of"):
        record_start("engines")


def test_a_ledger_that_cannot_be_written_is_said_and_never_fails_the_start(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(LEDGER_ENV, str(tmp_path / "no-such-dir" / "ledger.jsonl"))
    record_start("learner_group", world_size=2)
    assert f"could not record a learner_group start in {LEDGER_ENV}=" in capsys.readouterr().err


class Stop(Exception):
    """Raised by a faked part right after the start point, so nothing is really started."""


def _raise_stop(*args, **kwargs):
    raise Stop


def test_an_engine_is_counted_in_its_constructor_before_vllm_builds_it(tmp_path, monkeypatch):
    monkeypatch.setenv(LEDGER_ENV, str(tmp_path / "ledger.jsonl"))
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=_raise_stop))
    with pytest.raises(Stop):
        RolloutWorker("/nonexistent-model", RolloutConfig(), worker_index=5)
    assert [(x["kind"], x["worker_index"]) for x in ledger_lines(tmp_path / "ledger.jsonl")] == [("engine", 5)]


def test_a_learner_group_is_counted_once_by_its_rank_0(tmp_path, monkeypatch):
    monkeypatch.setenv(LEDGER_ENV, str(tmp_path / "ledger.jsonl"))
    monkeypatch.setattr(worker, "skip_deepspeed_muon", _raise_stop)  # the constructor's first step after the count
    for rank in (0, 1):
        with pytest.raises(Stop):
            worker.LearnerWorker("/nonexistent-model", LearnerConfig(), AlgoConfig(), rank=rank, world_size=2,
                                 master_addr="127.0.0.1", master_port=1, total_steps=1, seed=0)
    assert [(x["kind"], x["world_size"]) for x in ledger_lines(tmp_path / "ledger.jsonl")] == [("learner_group", 2)]


def test_an_embedded_ray_cluster_is_counted_once_it_started_and_a_joined_one_not(tmp_path, monkeypatch):
    monkeypatch.setenv(LEDGER_ENV, str(tmp_path / "ledger.jsonl"))
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: False, init=lambda **kw: None))
    monkeypatch.setitem(sys.modules, "ray._private", types.SimpleNamespace(  # what the embedded start reads of Ray
        ray_constants=types.SimpleNamespace(ENABLE_RAY_CLUSTER=True)))
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "no-token"))  # never the home's token file
    monkeypatch.setattr(ray_cluster, "join_cluster", lambda address, runtime_env=None: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray_cluster.start_ray("", num_cpus=8)
    ray_cluster.start_ray("10.0.0.5:6379", num_cpus=8)
    assert [(x["kind"], x["how"]) for x in ledger_lines(tmp_path / "ledger.jsonl")] == [("ray_cluster", "embedded")]


def test_the_reader_takes_each_completed_line_once_and_leaves_a_line_being_written(tmp_path):
    path = tmp_path / "ledger.jsonl"
    reader = LedgerReader(path)
    assert reader.take() == []  # no ledger yet: nothing started
    path.write_text('{"kind": "engine"}\n{"kind": "ray_cluster"}\n{"kind": "eng')
    assert [x["kind"] for x in reader.take()] == ["engine", "ray_cluster"]
    with open(path, "a") as f:
        f.write('ine"}\nnot json\n')
    assert [x["kind"] for x in reader.take()] == ["engine", "unreadable"]
    assert reader.take() == []
    assert count_starts([{"kind": "engine"}, {"kind": "engine"}, {"kind": "unreadable"}]) == {
        "engine": 2, "learner_group": 0, "ray_cluster": 0, "unreadable": 1}


def report(nodeid, when, duration, outcome="passed", starts=None, worker=None):
    props = [("raygrpo_starts", starts)] if starts is not None else []
    node = types.SimpleNamespace(gateway=types.SimpleNamespace(id=worker)) if worker else None
    return types.SimpleNamespace(nodeid=nodeid, when=when, duration=duration, failed=outcome == "failed",
                                 skipped=outcome == "skipped", user_properties=props, node=node)


def test_reports_from_two_workers_in_any_order_make_one_row_per_test():
    costs = CostsByTest()
    for r in [report("a.py::t1", "setup", 2.0, worker="gw0"), report("b.py::t2", "setup", 0.5, worker="gw1"),
              report("a.py::t1", "call", 10.0, worker="gw0"), report("b.py::t2", "call", 1.0, "failed", worker="gw1"),
              report("b.py::t2", "teardown", 0.25, starts={"engine": 1}, worker="gw1"),
              report("a.py::t1", "teardown", 1.0, starts={"engine": 2, "ray_cluster": 1}, worker="gw0"),
              report("c.py::t3", "setup", 0.1, "skipped", worker="gw1"),
              report("c.py::t3", "teardown", 0.0, starts={}, worker="gw1")]:
        costs.add(r)
    rows = costs.rows()
    assert [(r["nodeid"], r["duration_s"], r["outcome"], r["worker"]) for r in rows] == [
        ("a.py::t1", 13.0, "passed", "gw0"), ("b.py::t2", 1.75, "failed", "gw1"), ("c.py::t3", 0.1, "skipped", "gw1")]
    assert rows[0]["starts"] == {"engine": 2, "learner_group": 0, "ray_cluster": 1}
    summary = tier_summary(rows, wall_s=20.0, workers=2, args=["tests/e2e"])
    assert summary["totals"] == {"tests": 3, "failed": 1, "test_s": 14.8, "engine": 3, "learner_group": 0,
                                      "ray_cluster": 1}
    assert [(f["file"], f["tests"], f["engine"]) for f in summary["files"]] == [("a.py", 1, 2), ("b.py", 1, 1),
                                                                               ("c.py", 1, 0)]


def test_a_tier_replaces_its_own_section_and_keeps_the_others_and_the_table_lists_the_heaviest(tmp_path, capsys):
    out = tmp_path / "costs" / "suite-costs.json"
    light = {"nodeid": "u.py::t", "outcome": "passed", "duration_s": 0.5, "starts": count_starts([])}
    heavy = {"nodeid": "e.py::heavy", "outcome": "passed", "duration_s": 90.0,
             "starts": {"engine": 4, "learner_group": 1, "ray_cluster": 1}}
    few_s_many_engines = {"nodeid": "e.py::many", "outcome": "failed", "duration_s": 30.0,
                          "starts": {"engine": 9, "learner_group": 0, "ray_cluster": 0}}
    update_cost_file(out, "unit", tier_summary([light], 5.0, 2, ["tests/unit"]))
    update_cost_file(out, "e2e", tier_summary([light], 1.0, 2, ["tests/e2e"]))
    update_cost_file(out, "e2e", tier_summary([few_s_many_engines, heavy], 100.0, 2, ["tests/e2e"]))
    data = json.loads(out.read_text())
    assert set(data["tiers"]) == {"unit", "e2e"} and data["tiers"]["unit"]["totals"]["tests"] == 1
    assert [t["nodeid"] for t in data["tiers"]["e2e"]["tests"]] == ["e.py::heavy", "e.py::many"]
    table = out.with_suffix(".txt").read_text()
    assert "== e2e: 100 s wall" in table and "2 tests (1 failed)" in table and "13 engines, 1 learner groups" in table
    e2e_part = table.split("== e2e")[1]
    assert e2e_part.index("e.py::heavy") < e2e_part.index("e.py::many")
    by_engines = render(data, tier="e2e", by="engine")
    assert "== unit" not in by_engines and by_engines.index("e.py::many") < by_engines.index("e.py::heavy")
    assert main([str(out), "--tier", "e2e", "--top", "1"]) == 0
    printed = capsys.readouterr().out
    assert "e.py::heavy" in printed.split("-- by file")[0] and "e.py::many" not in printed.split("-- by file")[0]
    assert main([str(tmp_path / "none.json")]) == 1 and "make test" in capsys.readouterr().err


INNER_CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
pytest_plugins = ["suite_costs"]
"""

# What the start points do, from the test process and from a subprocess (a `raygrpo` run, a Ray actor);
# a module fixture's start is charged to the first test that asked for it.
INNER_A = """
import subprocess, sys, tempfile
import pytest
from actors.runtime.start_ledger import record_start

@pytest.fixture(scope="module")
def cluster():
    record_start("ray_cluster", how="test")
    yield

def test_two_engines_one_from_a_subprocess(cluster):
    record_start("engine")
    # from another directory, as a `raygrpo` run from the user's directory and a Ray actor in its own one
    subprocess.run([sys.executable, "-c", "from actors.runtime.start_ledger import record_start; record_start('engine')"],
                   check=True, cwd=tempfile.gettempdir())

def test_a_learner_group_on_the_shared_cluster(cluster):
    record_start("learner_group", world_size=2)

def test_nothing_started():
    pass
"""

INNER_B = """
from actors.runtime.start_ledger import record_start

def test_fails_after_starting_an_engine():
    record_start("engine")
    assert False
"""

EXPECTED = {"a.py::test_two_engines_one_from_a_subprocess": ({"engine": 2, "learner_group": 0, "ray_cluster": 1}, "passed"),
            "a.py::test_a_learner_group_on_the_shared_cluster": ({"engine": 0, "learner_group": 1, "ray_cluster": 0}, "passed"),
            "a.py::test_nothing_started": ({"engine": 0, "learner_group": 0, "ray_cluster": 0}, "passed"),
            "b.py::test_fails_after_starting_an_engine": ({"engine": 1, "learner_group": 0, "ray_cluster": 0}, "failed")}


@pytest.mark.parametrize("workers", [[], ["-n", "2", "--dist", "loadfile"]], ids=["one process", "two xdist workers"])
def test_an_inner_session_charges_each_start_to_the_test_that_made_it(tmp_path, monkeypatch, workers):
    monkeypatch.delenv(LEDGER_ENV, raising=False)  # an outer `make test` run's own ledger is not the inner one's
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(INNER_CONFTEST)
    (tmp_path / "a.py").write_text(textwrap.dedent(INNER_A))
    (tmp_path / "b.py").write_text(textwrap.dedent(INNER_B))
    out = tmp_path / "costs" / "suite-costs.json"
    # a relative path, as `make test` gives it: the ledger it names must still be found from other directories
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "a.py", "b.py", *workers,
                          "--suite-costs=costs/suite-costs.json", "--suite-costs-tier=e2e"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr  # b.py's test fails on purpose
    tier = json.loads(out.read_text())["tiers"]["e2e"]
    got = {t["nodeid"]: (t["starts"], t["outcome"]) for t in tier["tests"]}
    assert got == EXPECTED
    assert tier["totals"]["engine"] == 3 and tier["workers"] == (2 if workers else 1)
    assert {t["worker"] for t in tier["tests"]} == ({"gw0", "gw1"} if workers else {"main"})
    assert "suite costs (" in run.stdout and "3 engines, 1 learner groups, 1 Ray clusters" in run.stdout
    assert list((out.parent / "ledgers").iterdir()) == []  # each process removed its own ledger at its end


def test_start_ledger_imports_nothing_heavy():
    """Every actor and the driver import it: it must cost nothing (json, os, sys, time)."""
    code = f"import sys; sys.path.insert(0, {str(TESTS.parent)!r}); import actors.runtime.start_ledger; " \
           "print(sorted(m for m in ('torch', 'ray', 'vllm', 'numpy') if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"
    assert start_ledger.KINDS == ("engine", "learner_group", "ray_cluster")


def test_make_test_writes_both_tiers_into_the_file_the_readme_names():
    """Issue 58: each `make test` writes the file, and the README names it and says how to list the heaviest."""
    root = TESTS.parent
    make = (root / "Makefile").read_text()
    target = make[make.index("\ntest: "):].split("\n\n")[0]
    pytest_lines = [line for line in target.splitlines() if "-m pytest" in line]
    assert len(pytest_lines) == 2 and all("$(COSTS)" in line for line in pytest_lines), target
    assert "COSTS := --suite-costs=.cache/tests/suite-costs.json" in make
    assert "--suite-costs-tier=unit tests/unit" in pytest_lines[0] and "--suite-costs-tier=e2e" in pytest_lines[1]
    readme = (root / "README.md").read_text()
    assert ".cache/tests/suite-costs.json" in readme and "tests/suite_costs.py --top" in readme
