"""What each test cost: its seconds, and the vLLM engines, learner groups and Ray clusters it started.

`pytest --suite-costs=.cache/tests/suite-costs.json --suite-costs-tier=e2e` (what `make test` runs, once
per tier) writes that tier's section of the JSON file and, beside it, a text table of the heaviest tests
(suite-costs.txt). `python tests/suite_costs.py` prints the table again (`--top`, `--tier`, `--by`).

How the starts are counted (actors/runtime/start_ledger.py): every process that runs tests (the one
pytest process, or each pytest-xdist worker) sets RAYGRPO_START_LEDGER to a ledger file of its own before
any test runs. Each costly start appends a line to it from the process that pays for it: Ray actors
inherit the variable through the raylet of a cluster started from that process, `raygrpo` subprocesses
directly. A test's starts are the lines the ledger grew by from the end of the previous test's teardown
to the end of its own: fixture set-up and teardown included, so a shared (module or session) fixture is
charged to the first test that asked for it. The counts travel to the process that writes the file in
the teardown report's `user_properties` (xdist forwards them from its workers), so a worker's ledger is
never read by another process. A start that lands after the test that caused it ended (an engine Ray
restarts after its test returned) is charged to the next test of that process: the totals stay right.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections import Counter, defaultdict
from datetime import datetime, timezone
from pathlib import Path

import pytest

from actors.runtime.atomic_file import replace_text
from actors.runtime.start_ledger import KINDS, LEDGER_ENV

STARTS_PROPERTY = "raygrpo_starts"  # the user_properties key the counts travel under
COLUMNS = {"engine": "engines", "learner_group": "learner groups", "ray_cluster": "Ray clusters"}
DEFAULT_TOP = 25


class LedgerReader:
    """Reads a ledger from where it last stopped: each `take()` returns the lines completed since.

    A line still being written (no newline yet) is left for the next take; a line that is not JSON is
    counted as kind "unreadable" rather than dropped, so a corrupt ledger shows in the totals."""

    def __init__(self, path: Path):
        self.path, self.offset = Path(path), 0

    def take(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        lines = []
        for raw in data[:end].splitlines():
            if not raw.strip():
                continue
            try:
                lines.append(json.loads(raw))
            except ValueError:
                lines.append({"kind": "unreadable"})
        return lines


def count_starts(lines: list[dict]) -> dict[str, int]:
    """{kind: how many} over ledger lines, every kind of KINDS present (0 when none)."""
    counted = Counter(line.get("kind", "unreadable") for line in lines)
    return {**{k: 0 for k in KINDS}, **counted}


class CostsByTest:
    """Per test (nodeid): the seconds of its set-up, call and teardown, its outcome, the worker that ran
    it and the starts its teardown report carried. Fed every report, in whatever order they come."""

    def __init__(self):
        self.tests: dict[str, dict] = {}

    def add(self, report) -> None:
        row = self.tests.setdefault(report.nodeid, {"nodeid": report.nodeid, "outcome": "passed", "duration_s": 0.0,
                                                    "setup_s": 0.0, "call_s": 0.0, "teardown_s": 0.0,
                                                    "worker": "", "starts": count_starts([])})
        row[f"{report.when}_s"] = round(report.duration, 3)
        row["duration_s"] = round(row["setup_s"] + row["call_s"] + row["teardown_s"], 3)
        node = getattr(report, "node", None)  # pytest-xdist: the worker that ran it
        row["worker"] = getattr(getattr(node, "gateway", None), "id", row["worker"] or "main")
        if report.failed:
            row["outcome"] = "failed" if report.when == "call" else "error"
        elif report.skipped and row["outcome"] == "passed":
            row["outcome"] = "skipped"
        for key, value in report.user_properties:
            if key == STARTS_PROPERTY:
                row["starts"] = {**count_starts([]), **value}

    def rows(self) -> list[dict]:
        return sorted(self.tests.values(), key=lambda r: -r["duration_s"])


def tier_summary(rows: list[dict], wall_s: float, workers: int, args: list[str]) -> dict:
    """A tier's section of the cost file: the run's context, its totals, and its files and tests, heaviest first."""
    kinds = sorted({k for r in rows for k in r["starts"]} | set(KINDS), key=lambda k: (k not in KINDS, k))
    totals = {"tests": len(rows), "failed": sum(r["outcome"] in ("failed", "error") for r in rows),
              "test_s": round(sum(r["duration_s"] for r in rows), 1),
              **{k: sum(r["starts"].get(k, 0) for r in rows) for k in kinds}}
    files: dict[str, dict] = defaultdict(lambda: {"tests": 0, "test_s": 0.0, **{k: 0 for k in kinds}})
    for r in rows:
        f = files[r["nodeid"].split("::")[0]]
        f["tests"] += 1
        f["test_s"] = round(f["test_s"] + r["duration_s"], 3)
        for k in kinds:
            f[k] += r["starts"].get(k, 0)
    return {"finished_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "wall_s": round(wall_s, 1),
            "workers": workers, "machine": machine(), "commit": commit(), "args": args, "totals": totals,
            "files": sorted(({"file": k, **v} for k, v in files.items()), key=lambda f: -f["test_s"]),
            "tests": sorted(rows, key=lambda r: -r["duration_s"])}


def machine() -> dict:
    """The machine kind the figures belong to: CPU model, cores, memory, load average at the end."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        mem_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        mem_gb = None
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gb": mem_gb, "hostname": socket.gethostname(),
            "load_avg_end": [round(x, 2) for x in os.getloadavg()]}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def update_cost_file(path: Path, tier: str, summary: dict) -> None:
    """Replace `tier`'s section of the JSON file at `path` (the other tiers kept, each says when it ran),
    written through a temporary file and a rename; then the text table beside it (suite-costs.txt)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    data.setdefault("tiers", {})[tier] = summary
    replace_text(path, json.dumps(data, indent=1))
    path.with_suffix(".txt").write_text(render(data))


def render(data: dict, top: int = DEFAULT_TOP, tier: str | None = None, by: str = "duration_s") -> str:
    """Each tier: one line of context and totals, its `top` heaviest tests (by seconds, or by a start kind),
    then its files by seconds."""
    out = []
    for name, t in data.get("tiers", {}).items():
        if tier and name != tier:
            continue
        m, tot = t["machine"], t["totals"]
        out.append(f"== {name}: {t['wall_s']:.0f} s wall ({t['wall_s'] / 60:.1f} min) with {t['workers']} worker(s), "
                   f"{t['finished_at']}, commit {t['commit'] or '?'}, on {m['cpu']} ({m['cores']} cores, load "
                   f"{m['load_avg_end'][0]} at the end)")
        out.append(f"   {tot['tests']} tests ({tot['failed']} failed), {tot['test_s']:.0f} test-seconds; started: "
                   + ", ".join(f"{tot.get(k, 0)} {COLUMNS[k]}" for k in KINDS))
        # set-up: the test's share of fixture set-up (a module or session fixture's whole cost falls on the
        # first test that asked for it: a quick test can head the list for the cluster it started)
        head = f"{'seconds':>9} {'set-up':>7} {'engines':>7} {'learners':>8} {'clusters':>8}  {'outcome':<7}  "
        tests = sorted(t["tests"], key=lambda r: -(r[by] if by == "duration_s" else r["starts"].get(by, 0)))
        out += [f"-- the {min(top, len(tests))} heaviest tests (by {by})", head + "test"]
        out += [_row(r["duration_s"], r.get("setup_s", 0.0), r["starts"], r["outcome"], r["nodeid"]) for r in tests[:top]]
        out += ["-- by file", head + "file"]
        out += [_row(f["test_s"], None, f, f"{f['tests']} tests", f["file"]) for f in t["files"]]
        out.append("")
    return "\n".join(out)


def _row(seconds: float, setup_s: float | None, starts: dict, outcome: str, name: str) -> str:
    setup = f"{setup_s:>7.1f}" if setup_s is not None else f"{'':>7}"
    return (f"{seconds:>9.1f} {setup} {starts.get('engine', 0):>7} {starts.get('learner_group', 0):>8} "
            f"{starts.get('ray_cluster', 0):>8}  {outcome:<7}  {name}")


# ---- the pytest plugin (tests/conftest.py loads this module as one) ----

def pytest_addoption(parser):
    group = parser.getgroup("raygrpo suite costs")
    group.addoption("--suite-costs", metavar="PATH", default=None,
                    help="write each test's seconds and the engines, learner groups and Ray clusters it started "
                         "into this JSON file (and a table beside it, .txt); `make test` passes "
                         ".cache/tests/suite-costs.json")
    group.addoption("--suite-costs-tier", metavar="NAME", default="all",
                    help="the section of --suite-costs this run replaces (make test: unit, e2e)")


def pytest_configure(config):
    if config.getoption("suite_costs"):
        config.pluginmanager.register(SuiteCostsPlugin(config), "raygrpo-suite-costs")


class SuiteCostsPlugin:
    """In a process that runs tests: the ledger, and the starts on each teardown report. In the process
    that sees every report (the only one, or xdist's controller): the file at the session's end."""

    def __init__(self, config):
        self.config = config
        self.is_worker = hasattr(config, "workerinput")
        # Absolute: the ledger's path travels in RAYGRPO_START_LEDGER to processes in other directories (a
        # `raygrpo` run from the user's directory, a Ray actor), where `make test`'s relative path named nothing.
        self.out = Path(config.getoption("suite_costs")).resolve()
        self.costs = CostsByTest()
        self.t0 = time.monotonic()
        self.summary: dict | None = None
        # Every process gets a ledger of its own, before any fixture starts anything; xdist's controller runs
        # no test, so its ledger stays empty (its workers inherit its variable and set their own).
        ledgers = self.out.parent / "ledgers"
        ledgers.mkdir(parents=True, exist_ok=True)
        worker = config.workerinput["workerid"] if self.is_worker else "main"
        self.ledger = ledgers / f"{worker}-{os.getpid()}.jsonl"
        self.ledger.unlink(missing_ok=True)
        os.environ[LEDGER_ENV] = str(self.ledger)
        self.reader = LedgerReader(self.ledger)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        if call.when == "teardown":
            item.user_properties.append((STARTS_PROPERTY, count_starts(self.reader.take())))
        yield

    def pytest_runtest_logreport(self, report):
        if not self.is_worker:
            self.costs.add(report)

    def pytest_sessionfinish(self, session):
        # Every test's teardown report has taken its starts by now. Removed here, not only at unconfigure: an
        # xdist worker's unconfigure comes after it told the controller it finished, and a busy machine's
        # controller may end it first (execnet's 10 s exit timeout), which left the ledger behind.
        self.ledger.unlink(missing_ok=True)
        if self.is_worker:
            return
        workers = getattr(self.config.option, "numprocesses", None)  # pytest-xdist's -n, resolved to a number
        workers = workers if isinstance(workers, int) and workers > 0 else 1
        self.summary = tier_summary(self.costs.rows(), time.monotonic() - self.t0, workers,
                                    [str(a) for a in self.config.args])
        update_cost_file(self.out, self.config.getoption("suite_costs_tier"), self.summary)

    def pytest_unconfigure(self, config):
        os.environ.pop(LEDGER_ENV, None)
        self.ledger.unlink(missing_ok=True)

    def pytest_terminal_summary(self, terminalreporter):
        if self.summary is None:
            return
        tier = self.config.getoption("suite_costs_tier")
        text = render({"tiers": {tier: self.summary}}, top=10).split("-- by file")[0].rstrip()
        terminalreporter.write_sep("=", f"suite costs ({self.out}, table in {self.out.with_suffix('.txt')})")
        terminalreporter.write_line(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="The heaviest tests of the last `make test` (its suite-costs file).")
    p.add_argument("path", nargs="?", default=str(Path(__file__).resolve().parent.parent / ".cache/tests/suite-costs.json"))
    p.add_argument("--top", type=int, default=DEFAULT_TOP, help="how many tests per tier")
    p.add_argument("--tier", default=None, help="one tier (unit, e2e); all by default")
    p.add_argument("--by", default="duration_s", choices=["duration_s", *KINDS], help="what 'heaviest' means")
    a = p.parse_args(argv)
    try:
        data = json.loads(Path(a.path).read_text())
    except (OSError, ValueError) as e:
        print(f"no suite costs to read at {a.path} ({e}): `make test` writes them", file=sys.stderr)
        return 1
    print(render(data, top=a.top, tier=a.tier, by=a.by))
    return 0


if __name__ == "__main__":
    sys.exit(main())
