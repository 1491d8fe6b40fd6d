"""Issue 59, item 2, end to end: an engine killed past its restart budget at rollout.min_workers stops the run
with a checkpoint of its last step, and the same command with a larger budget finishes with every step once.

    .venv/bin/python examples/engine_past_budget.py [--run-dir DIR] [--model DIR] [--steps N] [--kill-at K]

1. `raygrpo train` with 2 engines, rollout.min_workers=2 and rollout.max_restarts=0 (checkpoint.every=0: no
   checkpoint but the last, the issue's case): rollout worker 1's process (its pid from RUN_DIR/placement.json)
   is SIGKILLed while step K runs. Checked: the exit is non-zero, the console names the engine and what to
   change, and says what to rerun; the run dir holds a checkpoint of the last step metrics.jsonl logged.
2. The same command with rollout.max_restarts=2 (checkpoint.resume=auto, the default, resumes from that
   checkpoint), rollout worker 1 SIGKILLed again two steps later: Ray restarts it within the budget, and the
   run finishes with every step 1..N logged exactly once across both runs.

A runnable check, not a test of the suite: two runs of real Ray, vLLM and DeepSpeed (a few minutes each on
2 cores). The model is the tests' tiny chat model (tests/e2e builds .cache/tests/tiny-chat-qwen2-h128-l2).
It prints the lines that show each point and exits 1 if one does not hold.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RAYGRPO = Path(sys.executable).parent / "raygrpo"
WAIT_S = 900.0  # at most this for a run's step or its end (a loaded 2-core machine)


def command(run_dir: Path, model: Path, steps: int, max_restarts: int) -> list[str]:
    """The run: the CPU demo's config on a tiny model, 2 engines at rollout.min_workers=2, no checkpoint but the last."""
    return [str(RAYGRPO), "train", str(ROOT / "examples/cpu_demo.yaml"), f"model.path={model}",
            f"trainer.run_dir={run_dir}", f"trainer.steps={steps}", "trainer.prompts_per_step=4", "trainer.group_size=4",
            "trainer.dynamic_sampling=false", "trainer.eval_every=0", "data.num_eval=0", "data.task_digits=1",
            "trainer.halt_after=0", "checkpoint.every=0", "rollout.num_workers=2", "rollout.min_workers=2",
            f"rollout.max_restarts={max_restarts}", "rollout.num_cpus=1", "learner.num_cpus=2",
            "rollout.max_model_len=48", "rollout.max_new_tokens=4", "rollout.gpu_memory_utilization=0.03",
            "rollout.cpu_kv_cache_mb=32", "algo.beta=0", "metrics.tensorboard=false"]


def train_steps(run_dir: Path) -> list[int]:
    """The steps metrics.jsonl logged, in order (a torn last line is skipped)."""
    steps = []
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return steps
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("kind") == "train":
            steps.append(row["step"])
    return steps


def engine_pid(run_dir: Path, role: str = "rollout-1") -> int:
    listed = json.loads((run_dir / "placement.json").read_text())
    return next(p["pid"] for p in listed if p["role"] == role)


def kill_engine_at(proc: subprocess.Popen, run_dir: Path, logged: int) -> tuple[int, int]:
    """SIGKILL rollout worker 1 once metrics.jsonl has `logged` steps (so while the next one runs): (pid, step)."""
    t0 = time.monotonic()
    while len(train_steps(run_dir)) < logged:
        if proc.poll() is not None:
            raise SystemExit(f"the run ended (exit {proc.returncode}) before step {logged}: see its console")
        if time.monotonic() - t0 > WAIT_S:
            proc.terminate()
            raise SystemExit(f"no step {logged} within {WAIT_S:.0f}s")
        time.sleep(0.5)
    pid = engine_pid(run_dir)
    os.kill(pid, signal.SIGKILL)
    return pid, len(train_steps(run_dir)) + 1


def run(cmd: list[str], console: Path, kill_after: int) -> tuple[int, str, int, int]:
    """Start the run, kill rollout worker 1 after `kill_after` logged steps, wait for its end:
    (exit status, console text, the killed pid, the step it was killed in)."""
    run_dir = Path(next(a for a in cmd if a.startswith("trainer.run_dir=")).split("=", 1)[1])
    with console.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            pid, step = kill_engine_at(proc, run_dir, kill_after)
            print(f"  SIGKILL rollout worker 1 (pid {pid}) during step {step}", flush=True)
            rc = proc.wait(timeout=WAIT_S)
        except BaseException:
            if proc.poll() is None:  # our own run only: SIGTERM stops it with its actors
                proc.terminate()
                proc.wait(timeout=60)
            raise
    return rc, console.read_text(), pid, step


def lines_with(text: str, *needles: str) -> list[str]:
    return [line for line in text.splitlines() if any(n in line for n in needles)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", type=Path, default=Path("/tmp/raygrpo-engine-past-budget/run"))
    ap.add_argument("--model", type=Path, default=ROOT / ".cache/tests/tiny-chat-qwen2-h128-l2")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--kill-at", type=int, default=4, help="the step during which rollout worker 1 is killed")
    args = ap.parse_args()
    if not (args.model / "config.json").exists():
        print(f"no model at {args.model}: run the e2e tests once (they build it), or pass --model DIR", file=sys.stderr)
        return 2
    shutil.rmtree(args.run_dir, ignore_errors=True)
    args.run_dir.mkdir(parents=True)
    failed = []

    def check(ok: bool, what: str) -> None:
        print(f"  [{'ok' if ok else 'FAILED'}] {what}", flush=True)
        if not ok:
            failed.append(what)

    t0 = time.monotonic()
    print(f"1. rollout.max_restarts=0, rollout.min_workers=2, {args.steps} steps (console: {args.run_dir}.1.console)")
    rc, said, pid, killed_in = run(command(args.run_dir, args.model, args.steps, 0), Path(f"{args.run_dir}.1.console"),
                                   args.kill_at - 1)
    logged = train_steps(args.run_dir)
    ckpts = sorted(p.name for p in (args.run_dir / "checkpoints").glob("step-*"))
    for line in lines_with(said, "rollout worker 1", "the run stops", "Error", "rerun"):
        print("  > " + line[:400])
    check(rc != 0, f"the run failed (exit {rc})")
    check(any("rollout worker 1" in line and "rollout.max_restarts" in line and "rollout.min_workers=2" in line
              for line in said.splitlines()), "the error names rollout worker 1, rollout.max_restarts and rollout.min_workers")
    check("run the same command again to resume from it" in said, "the console says what to rerun")
    last = logged[-1] if logged else 0
    check(bool(logged) and ckpts == [f"step-{last:08d}"], f"a checkpoint of the last logged step {last}: {ckpts}")
    print(f"   ({time.monotonic() - t0:.0f}s)")

    t1 = time.monotonic()
    print(f"2. the same command with rollout.max_restarts=2 (console: {args.run_dir}.2.console)")
    rc2, said2, pid2, killed_in2 = run(command(args.run_dir, args.model, args.steps, 2), Path(f"{args.run_dir}.2.console"),
                                       last + 2)
    logged2 = train_steps(args.run_dir)
    for line in lines_with(said2, "resum", "rollout worker 1", "done:"):
        print("  > " + line[:400])
    check(rc2 == 0, f"the run finished (exit {rc2})")
    check(engine_pid(args.run_dir) != pid2, f"Ray restarted rollout worker 1 (pid {pid2} -> {engine_pid(args.run_dir)})")
    check(logged2 == list(range(1, args.steps + 1)), f"every step logged once: {logged2}")
    print(f"   ({time.monotonic() - t1:.0f}s)")
    print("PASSED" if not failed else f"FAILED: {'; '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
