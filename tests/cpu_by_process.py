"""Where a command's CPU goes, by kind of process: `python tests/cpu_by_process.py OUT.json -- CMD ...`
runs CMD (the test suite: `.ci/run`), reads /proc every second while it runs, and prints the CPU seconds
of every process that started meanwhile, summed by kind (a Ray actor's class, `raylet`, `cc1plus`, a
Python script's name), with the machine's busy CPU seconds over the same time and how busy it was.
`python tests/cpu_by_process.py OUT.json` prints the table of an earlier run again.

Why by process and not by test: on 2 cores the suite keeps both busy (90% of its time on a quiet
machine), so its wall time is its CPU time over 2, and CPU time is what a change has to remove.
A process's CPU is read last while it lives (up to a second is lost per process); a process that
lives under a second may be missed.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import defaultdict

HZ = os.sysconf("SC_CLK_TCK")


def busy_seconds() -> float:
    """The machine's busy CPU seconds since boot (all but idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / HZ


def read_process(pid: str) -> tuple[float, str, str] | None:
    """(CPU seconds, comm, command line) of a live process, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cmdline") as f:
            cmd = f.read().replace("\0", " ").strip()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / HZ, stat[stat.find("(") + 1:stat.rfind(")")], cmd


def kind(comm: str, cmd: str) -> str:
    """What a process is, for the table: a Ray worker's process name (`ray::RolloutWor`: the kernel keeps 15
    characters of the title Ray gives it, and its command line is not always retitled), else a Python
    script's or module's name, else the executable's name."""
    if comm.startswith("ray::"):
        return comm
    if comm.startswith("python"):
        m = re.search(r"(?:^|\s)-m\s+(\S+)|(\S+\.py)\b", cmd)
        return "python " + (m[1] or os.path.basename(m[2])) if m else "python"
    return comm


def by_kind(procs: dict[str, list]) -> dict[str, list[float]]:
    """kind -> [CPU seconds, processes], from {pid: [cpu, comm, cmd]}."""
    table: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for cpu, comm, cmd in procs.values():
        row = table[kind(comm, cmd)]
        row[0] += cpu
        row[1] += 1
    return dict(table)


def report(run: dict, top: int = 30) -> str:
    table = sorted(by_kind(run["procs"]).items(), key=lambda kv: -kv[1][0])
    lines = [f"wall {run['wall']:.0f} s, machine busy {run['busy']:.0f} CPU-s ({run['busy'] / run['wall']:.2f} of "
             f"{os.cpu_count()} cores), read from its processes {sum(r[0] for _, r in table):.0f} CPU-s",
             f"{'CPU-s':>8} {'procs':>6}  kind"]
    lines += [f"{cpu:8.1f} {int(n):6d}  {name}" for name, (cpu, n) in table[:top]]
    return "\n".join(lines)


def watch(cmd: list[str]) -> dict:
    before = set(os.listdir("/proc"))
    procs: dict[str, list] = {}
    b0, t0 = busy_seconds(), time.time()
    child = subprocess.Popen(cmd)
    while child.poll() is None:
        for pid in os.listdir("/proc"):
            if pid.isdigit() and pid not in before and (seen := read_process(pid)) is not None:
                procs[pid] = list(seen)  # the latest title: an idle Ray worker renames itself for its actor
        time.sleep(1.0)
    return {"rc": child.returncode, "wall": time.time() - t0, "busy": busy_seconds() - b0, "procs": procs}


def main(argv: list[str]) -> int:
    if not argv or (len(argv) > 1 and argv[1] != "--"):
        print(__doc__, file=sys.stderr)
        return 2
    if len(argv) == 1:
        with open(argv[0]) as f:
            print(report(json.load(f)))
        return 0
    run = watch(argv[2:])
    with open(argv[0], "w") as f:
        json.dump(run, f)
    print(report(run))
    return run["rc"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
