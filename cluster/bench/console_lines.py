"""How much of a run's console is raygrpo's own: count the lines of a saved console log by origin.

    raygrpo train run.yaml > console.log 2>&1
    python -m cluster.bench.console_lines console.log [--show third-party|raygrpo]

A line is third-party when it has the shape of another library's output (THIRD_PARTY: vLLM's and
Ray's log lines, DeepSpeed's, torch's C++ warnings, Python warnings with their source line,
progress bars, tracebacks, Ray's line-prefix markers); every other non-empty line is counted as
raygrpo's. `--show` prints one class, so the split can be checked by eye.
"""
from __future__ import annotations

import argparse
import re
import sys

ANSI = re.compile(r"\x1b\[[0-9;]*m")
RAY_PREFIX = re.compile(r"^\((?:[\w.]+ )?pid=\d+(?:, ip=[\d.]+)?\) ?")  # "(RolloutWorker pid=12) " added by Ray
THIRD_PARTY = [re.compile(p) for p in (
    r"^(\(\w+ pid=\d+\) )?(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \[",  # vLLM
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+(DEBUG|INFO|WARNING|ERROR)",  # Ray (and Python logging's default)
    r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\] \[(DEBUG|INFO|WARNING|ERROR)\]",  # DeepSpeed
    r"^\[[WIE]\d{4} ",  # torch / c10 C++ logging
    r"^(DEBUG|INFO|WARNING|ERROR) \[[\w.]+(:\d+)?\] ",  # a third-party record on the quiet console (cluster/run/logs.py)
    r"\w*(Warning|Error): ",  # Python warnings and exceptions
    r"^\s*(Traceback \(most recent call last\)|File \".*\", line \d+)",
    r"\d+%\|.*\|", r"\d+/\d+ \[[\d:<]+", r"it/s\]$",  # progress bars
    r"^Triton is installed", r"^DeepSpeed .* built successfully", r"\[repeated \d+x across cluster\]",
    r"^:(actor_name|job_id|task_name):",
)]


def classify(lines: list[str]) -> list[tuple[str, str]]:
    """(origin, line) per non-empty line: origin 'raygrpo' or 'third-party'. A line indented under a
    third-party line (a warning's source line, a traceback's code) is third-party too."""
    out, previous = [], "raygrpo"
    for raw in lines:
        line = ANSI.sub("", raw.rstrip("\n"))
        body = RAY_PREFIX.sub("", line)
        if not body.strip():
            continue
        third = any(p.search(body) for p in THIRD_PARTY) or (previous == "third-party" and body[:1].isspace())
        previous = "third-party" if third else "raygrpo"
        out.append((previous, line))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.bench.console_lines", description=__doc__.splitlines()[0])
    p.add_argument("log", nargs="+", help="saved console output (stdout and stderr together)")
    p.add_argument("--show", choices=("raygrpo", "third-party"), default=None, help="print the lines of one class")
    args = p.parse_args(argv)
    for path in args.log:
        with open(path, errors="replace") as f:
            lines = classify(f.readlines())
        ours = sum(origin == "raygrpo" for origin, _ in lines)
        print(f"{path}: {len(lines)} non-empty lines, {ours} raygrpo's, {len(lines) - ours} third-party "
              f"({100 * ours / max(len(lines), 1):.0f}% raygrpo's)")
        for origin, line in lines:
            if origin == args.show:
                print(f"    {line[:160]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
