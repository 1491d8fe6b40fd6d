"""Plant each bug of the table below, one at a time, in a throw-away copy of the tree, and show which test catches it
(issue 58, item 5): `.venv/bin/python tests/planted_bugs.py [--bug NAME] [--out FILE] [--lock FILE]`.

For each row: a copy of the committed tree (`--ref`, default HEAD; nothing is planted in the checkout, where
others run tests), its one snippet replaced (a snippet not found exactly once fails the row: the table cannot
rot silently), its tests run there with the checkout's interpreter and the copy first on PYTHONPATH (a pytest
plugin written into the copy stops the run if `actors`, `cluster` or `learner` come from anywhere else: the
package is installed editable from the checkout). "caught" when they fail, "MISSED" when they pass; every row's
tests first run once on the unplanted copy and must pass there, else the row is "not a baseline". Exits 1 unless
every row is caught. `--lock FILE` is held around each run that includes an end-to-end test (the team's one lock
for heavy runs); a row whose only catching test is end to end names it under tests/e2e/. The whole table takes
about 4 minutes on a 2-core machine. tests/unit/test_planted_bugs.py checks the table alone (every snippet found,
every test node collected) in the unit tier.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PlantedBug:
    name: str  # what --bug selects
    file: str  # relative to the repository root
    snippet: str  # must occur exactly once in `file`
    replacement: str  # the bug
    suffers: str  # what a user would suffer
    tests: tuple[str, ...]  # pytest node ids expected to fail with the bug planted (cheapest first)


BUGS: list[PlantedBug] = [
    PlantedBug(
        name="rejoin-without-resync",
        file="cluster/driver/engine_weights.py",
        snippet='print(f"rollout worker {worker_index} is up; sending it weights version {self.versions.learner}", '
                'flush=True)\n        self.resync(worker_index)\n',
        replacement='print(f"rollout worker {worker_index} is up; sending it weights version {self.versions.learner}", '
                    'flush=True)\n',
        suffers="an engine back after a lost host samples with the weights it had (or the base model's) and the "
                "learner trains on those tokens as if fresh",
        tests=("tests/unit/test_engine_updates.py::"
               "test_an_engine_back_in_the_fleet_gets_its_threads_then_the_current_weights_verified",),
    ),
    PlantedBug(
        name="resume-logs-a-step-twice",
        file="cluster/run/metrics.py",
        snippet="return step < start_step or (step == start_step",
        replacement="return step <= start_step + 1 or (step == start_step",
        suffers="after a resume metrics.jsonl holds the first redone step twice (the old row kept beside the "
                "new one): plots, `raygrpo show` and exports count it twice",
        tests=("tests/unit/test_metrics.py",),
    ),
    PlantedBug(
        name="lost-engines-prompts-dropped",
        file="cluster/driver/rollout_pool.py",
        snippet="            if orphans:  # the share of engines lost with their host: to the ones that are live\n"
                "                for w, idx in zip(self.live, split_evenly(sorted(orphans), len(self.live))):\n"
                "                    if idx:\n"
                "                        again[w] = again.get(w, []) + idx\n"
                "            pending = again\n"
                "        return [results[i] for i in range(n)]\n",
        replacement="            pending = again\n"
                    "        return [results[i] for i in sorted(results)]\n",
        suffers="when an engine leaves the fleet its share of the step's prompts is silently not generated: "
                "smaller batches, prompts skipped from the data order",
        tests=("tests/unit/test_driver_seam.py::"
               "test_an_engine_dead_past_rollout_max_restarts_leaves_the_fleet_until_rollout_min_workers",),
    ),
    PlantedBug(
        name="fingerprint-check-skipped",
        file="learner/weight_sync.py",
        snippet="                check(expected, reports)\n",
        replacement="                pass  # the engines' fingerprints are not compared\n",
        suffers="an update left out or partial on an engine goes unnoticed: it samples from other weights than "
                "the ones trained, and the rows still say sync_verified",
        tests=("tests/e2e/test_learner_weight_sync.py::"
               "test_an_update_the_engine_left_out_fails_the_sync_naming_the_engine_and_a_tensor",),
    ),
    PlantedBug(
        name="failed-reward-counted-as-zero",
        file="actors/rewards/scorer.py",
        snippet="scale = total / kept if broken and kept else 1.0",
        replacement="scale = 1.0",
        suffers="a reward function that fails (a verifier down) pulls every reward toward 0 instead of being "
                "left out with the others' weights renormalised: the reward curve drops for no reason",
        tests=("tests/unit/test_driver_seam.py::"
               "test_a_reward_function_failing_alone_is_left_out_then_the_guard_saves_a_checkpoint_before_it_halts",),
    ),
    PlantedBug(
        name="stale-batch-accepted",
        file="cluster/driver/schedules/collecting.py",
        snippet="if self.versions.learner - batch.weight_version > self.cfg.trainer.max_staleness:",
        replacement="if self.versions.learner - batch.weight_version > self.cfg.trainer.max_staleness + 1:",
        suffers="sync/async runs train on batches older than trainer.max_staleness (off-policy beyond the bound "
                "the user set)",
        tests=("tests/unit/test_collect.py::test_a_batch_older_than_max_staleness_is_generated_again_before_training",),
    ),
    PlantedBug(
        name="pipeline-stale-group-accepted",
        file="cluster/driver/pipeline.py",
        snippet="if version - oldest > t.max_staleness:",
        replacement="if version - oldest > t.max_staleness + 1:",
        suffers="pipeline runs train on groups older than trainer.max_staleness",
        tests=("tests/unit/test_pipeline.py",),
    ),
    PlantedBug(
        name="rejoin-not-handed-to-the-weights",
        file="cluster/driver/comebacks.py",
        snippet="        self.weights.rejoined(worker_index)\n",
        replacement="",
        suffers="as rejoin-without-resync, one layer up: the pool's on_rejoin records where the engine runs now but "
                "never asks for its weights",
        tests=("tests/unit/test_engine_updates.py::"
               "test_the_pools_on_rejoin_records_where_the_engine_runs_and_sends_it_the_weights",),
    ),
    PlantedBug(
        name="restart-without-resync",
        file="cluster/driver/engine_weights.py",
        snippet='+ f"; re-syncing weights version {self.versions.learner}", flush=True)\n        self.resync(worker_index)\n',
        replacement='+ f"; re-syncing weights version {self.versions.learner}", flush=True)\n',
        suffers="an engine Ray restarted as a new process (base weights) generates for the step without the "
                "current weights: its tokens trained as if sampled from the policy being trained",
        tests=("tests/unit/test_driver_seam.py::"
               "test_an_engine_ray_restarts_as_a_new_process_is_resynced_and_verified_before_its_prompts_go_again",),
    ),
    PlantedBug(
        name="kl-sign-flipped",
        file="learner/grpo.py",
        snippet="return KL_ESTIMATORS[estimator](ref_logp - logp)",
        replacement="return KL_ESTIMATORS[estimator](logp - ref_logp)",
        suffers="the KL penalty (k1, k3) measures KL(pi_ref || pi) with the wrong sign of d: k1 rewards drifting "
                "away from the reference, k3 penalises the wrong direction",
        tests=("tests/unit/test_grpo.py::test_kl_estimators_hand_values",),
    ),
    PlantedBug(
        name="advantage-std-biased",
        file="learner/grpo.py",
        snippet="(r.std(dim=1, keepdim=True, unbiased=True) + eps)",
        replacement="(r.std(dim=1, keepdim=True, unbiased=False) + eps)",
        suffers="GRPO advantages scaled by sqrt(G/(G-1)) against TRL and verl: a silently different step size",
        tests=("tests/unit/test_grpo.py::test_grpo_advantages_hand_values",),
    ),
    PlantedBug(
        name="group-rewards-off-by-one",
        file="cluster/driver/batch.py",
        snippet="rewards = res.rewards[g * G:(g + 1) * G]",
        replacement="rewards = (res.rewards[1:] + res.rewards[:1])[g * G:(g + 1) * G]",
        suffers="each completion is trained with its neighbour's reward (the groups shifted by one sample)",
        tests=("tests/unit/test_collect.py",),
    ),
    PlantedBug(
        name="reward-guard-halts-a-step-late",
        file="cluster/run/health.py",
        snippet="if t.halt_after and self.failing[name] >= t.halt_after]",
        replacement="if t.halt_after and self.failing[name] > t.halt_after]",
        suffers="a reward function failing every call is tolerated one step longer than trainer.halt_after says: "
                "a step trained on the other functions alone beyond the user's bound",
        tests=("tests/unit/test_driver_seam.py::"
               "test_a_reward_function_failing_alone_is_left_out_then_the_guard_saves_a_checkpoint_before_it_halts",),
    ),
    PlantedBug(
        name="reward-timeout-ten-times-late",
        file="actors/rewards/pool.py",
        snippet="slot.inflight[idx] = (time.monotonic() + self.timeout_s, threaded)",
        replacement="slot.inflight[idx] = (time.monotonic() + 10 * self.timeout_s, threaded)",
        suffers="a hung reward call (an endless loop in a user's function) holds the step ten times "
                "reward.timeout_s before it is given up on",
        tests=("tests/unit/test_reward_isolation.py::test_hung_calls_time_out_together_not_one_after_another",),
    ),
    PlantedBug(
        name="lora-adapter-check-skipped",
        file="actors/transport/lora_adapter.py",
        snippet="        verify_s = verify_engines(self.handles, expected, adapter=True, timeout_s=self.timeout_s,\n"
                "                                  scale={n: self.scaling() for n in tensors if \".lora_B.\" in n})\n",
        replacement="        verify_s = 0.0  # the engines' adapters are not compared\n",
        suffers="with learner.lora_sync=adapter, an engine that did not load the new adapter (or loaded it scaled "
                "otherwise) goes unnoticed: it samples from another policy than the one trained",
        tests=("tests/unit/test_adapter_sync_check.py",),
    ),
    PlantedBug(
        name="resume-on-other-base-weights",
        file="cluster/data/model_check.py",
        snippet="changed = base_weights_problem(ckpt, hf_meta_dir, model_path) if taken else None",
        replacement="changed = None  # model.path's weights are not compared",
        suffers="a LoRA run (or one with a KL term) resumed after model.path was overwritten by another model of "
                "the same architecture goes on with another base or reference than it trained with, quietly",
        tests=("tests/unit/test_model_check.py::test_a_resume_that_takes_weights_from_a_changed_model_path_is_refused",),
    ),
]


# ------------------------------------------------------------------ planting and running
ROOT = Path(__file__).resolve().parent.parent
PYTHON = ROOT / ".venv" / "bin" / "python"
GUARD_EXIT = 7  # the guard's exit status: the copy's packages were not the ones imported

# Written into each copy and loaded with -p: a run whose `actors`, `cluster` or `learner` comes from anywhere but
# the copy (the package is installed editable from the checkout) would test the unplanted code and report MISSED.
GUARD = '''import os, pytest, actors, cluster, learner
def pytest_sessionstart(session):
    copy = os.environ["PLANTED_COPY"]
    for m in (actors, cluster, learner):
        if not os.path.realpath(m.__file__).startswith(copy + os.sep):
            pytest.exit(f"{m.__name__} imported from {m.__file__}, not from the copy {copy}", returncode=GUARD_EXIT)
'''.replace("GUARD_EXIT", str(GUARD_EXIT))


class PlantError(RuntimeError):
    """A row's snippet is not in its file exactly once: the table has rotted."""


def plant(tree: Path, bug: PlantedBug) -> None:
    path = tree / bug.file
    text = path.read_text()
    found = text.count(bug.snippet)
    if found != 1:
        raise PlantError(f"{bug.name}: the snippet occurs {found} times in {bug.file} (want exactly 1):\n{bug.snippet}")
    path.write_text(text.replace(bug.snippet, bug.replacement))


def copy_tree(ref: str, into: Path) -> Path:
    """The committed tree at `ref` (git archive: nobody's uncommitted edits, no worktree to clean up)."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", ref], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    (into / "_planted_guard.py").write_text(GUARD)
    return into.resolve()


@dataclass
class Outcome:
    rc: int
    seconds: float
    failed: list[str]  # the node ids (as junit names them) that failed or errored
    ran: list[str]  # every node id reported
    tail: str
    why: str = ""  # the first failure's message, first line: what the planted bug broke


def run_tests(tree: Path, nodes: list[str], timeout_s: float, lock: Path | None) -> Outcome:
    """The nodes run in `tree` by the checkout's interpreter, the copy first on the path; `lock` held around a
    run that includes an end-to-end test (one heavy run at a time on a shared machine)."""
    report = tree / f"junit-{time.monotonic_ns()}.xml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "PLANTED_COPY": str(tree), "RAYGRPO_TEST_CACHE": os.environ.get("RAYGRPO_TEST_CACHE", str(ROOT / ".cache" / "tests"))}
    cmd = [str(PYTHON), "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-p", "_planted_guard", "-q",
           f"--junitxml={report}", *nodes]
    heavy = lock is not None and end_to_end(nodes)
    with open(lock, "w") if heavy else contextlib.nullcontext() as held:
        if held is not None:
            fcntl.flock(held, fcntl.LOCK_EX)
        t0 = time.monotonic()
        try:
            p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
            rc, out = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            partial = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
            rc, out = -1, f"timed out after {timeout_s:.0f}s\n{partial}"
        seconds = time.monotonic() - t0
    if rc == GUARD_EXIT:
        raise SystemExit(f"the copy's code was not what got imported:\n{out[-2000:]}")
    failed, ran, why = [], [], ""
    if report.is_file():
        for case in ET.parse(report).getroot().iter("testcase"):
            node = case.get("classname", "").replace(".", "/") + ".py::" + case.get("name", "")
            ran.append(node)
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            if bad is not None:
                failed.append(node)
                why = why or (bad.get("message") or "").strip().split("\n")[0][:300]
    return Outcome(rc, seconds, failed, ran, out[-3000:], why)


def end_to_end(nodes) -> bool:
    """Whether any of the test node ids is an end-to-end test (run under --lock; its rows run last)."""
    return any(n.startswith("tests/e2e/") for n in nodes)


def covers(node: str, ran: list[str]) -> list[str]:
    """The reported node ids that a named node (a file, a test, a parametrised test) selected."""
    file = node.split("::")[0]
    return [r for r in ran if r == node or r.startswith(node + "[") or ("::" not in node and r.startswith(file + "::"))]


@dataclass
class Row:
    bug: PlantedBug
    result: str  # caught / MISSED / not a baseline / snippet not found
    caught_by: list[str]
    seconds: float
    why: str = ""


def try_bug(bug: PlantedBug, ref: str, scratch: Path, baseline: Outcome, timeout_s: float, lock: Path | None) -> Row:
    """`baseline`: the same tests on the unplanted copy, which must have run and passed every one of them."""
    if baseline.rc != 0 or not all(covers(n, baseline.ran) for n in bug.tests):
        print(f"{bug.name}: its tests do not pass unplanted (exit {baseline.rc}):\n{baseline.tail}", file=sys.stderr)
        return Row(bug, "not a baseline (its tests fail or are missing unplanted)", [], 0.0)
    tree = copy_tree(ref, scratch / bug.name)
    try:
        plant(tree, bug)
    except PlantError as e:
        print(e, file=sys.stderr)
        return Row(bug, "snippet not found exactly once", [], 0.0)
    out = run_tests(tree, list(bug.tests), timeout_s, lock)
    shutil.rmtree(tree, ignore_errors=True)
    if out.rc == 0:
        return Row(bug, "MISSED", [], out.seconds)
    if out.rc == -1:
        return Row(bug, "caught (timed out)", list(bug.tests), out.seconds)
    if out.failed:
        return Row(bug, "caught", out.failed, out.seconds, out.why)
    print(f"{bug.name}: pytest exit {out.rc} with no failed test:\n{out.tail}", file=sys.stderr)
    return Row(bug, f"caught? (pytest exit {out.rc}, no test failed)", [], out.seconds)


def table(rows: list[Row], commit: str) -> str:
    head = (f"{len(rows)} planted bugs at commit {commit[:10]}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
            f"on {platform.node()} ({cpu_name()}, {os.cpu_count()} cores); seconds: the planted run's wall time.\n\n"
            "| bug | file | what a user would suffer | test that caught it | how it failed | result | seconds |\n"
            "|---|---|---|---|---|---|---|\n")
    lines = [f"| {r.bug.name} | `{r.bug.file}` | {cell(r.bug.suffers)} | {caught_by(r)} | {cell(r.why[:120])} | "
             f"{r.result} | {r.seconds:.0f} |" for r in rows]
    return head + "\n".join(lines) + "\n"


def cell(text: str) -> str:
    """Text for a markdown table cell: its pipes escaped, on one line."""
    return text.replace("|", "&#124;").replace("\n", " ")


def caught_by(row: Row, shown: int = 3) -> str:
    """The failed tests (the first `shown`, then how many more), or the row's tests where none failed."""
    nodes = row.caught_by or list(row.bug.tests)
    more = f"<br>and {len(nodes) - shown} more" if len(nodes) > shown else ""
    return "<br>".join(f"`{n}`" for n in nodes[:shown]) + more


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bug", action="append", choices=[b.name for b in BUGS], help="only this row (repeatable)")
    ap.add_argument("--ref", default="HEAD", help="the commit planted in (default HEAD)")
    ap.add_argument("--out", type=Path, help="also write the markdown table here")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds for one row's tests")
    ap.add_argument("--lock", type=Path, help="a file to flock around runs that include end-to-end tests")
    args = ap.parse_args(argv)
    bugs = [b for b in BUGS if not args.bug or b.name in args.bug]
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", args.ref], check=True, capture_output=True,
                            text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="planted-") as scratch:
        clean = copy_tree(commit, Path(scratch) / "unplanted")
        baselines: dict[tuple[str, ...], Outcome] = {}  # rows naming the same tests share their unplanted run
        rows = []
        for bug in sorted(bugs, key=lambda b: end_to_end(b.tests)):  # the cheap rows first: an end-to-end row may wait for the lock
            if bug.tests not in baselines:
                baselines[bug.tests] = run_tests(clean, list(bug.tests), args.timeout, args.lock)
            rows.append(try_bug(bug, commit, Path(scratch), baselines[bug.tests], args.timeout, args.lock))
            print(f"{bug.name}: {rows[-1].result} in {rows[-1].seconds:.0f}s (unplanted "
                  f"{baselines[bug.tests].seconds:.0f}s) {rows[-1].caught_by} {rows[-1].why}", flush=True)
    rows.sort(key=lambda r: bugs.index(r.bug))  # the table's order
    text = table(rows, commit)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if all(r.result.startswith("caught") and "?" not in r.result for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
