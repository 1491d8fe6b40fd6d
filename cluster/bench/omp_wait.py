"""`python -m cluster.bench.omp_wait`: what OpenMP's wait policy costs when processes share the cores, as a run's
actors (and two test workers' runs) do on a CPU machine. raygrpo sets no policy: libgomp's default wins where a
process has its cores to itself, PASSIVE where processes crowd them (docs/benchmarks.md, "OpenMP's wait policy").

Starts `--procs` Python processes at once, each running the same torch MLP (8 layers of `--width`) forward and backward `--iters`
times on `--threads` threads, once per policy (libgomp's default: spin at a barrier up to GOMP_SPINCOUNT polls,
then sleep; PASSIVE: sleep at once), and prints each process's wall and CPU seconds and the load average. With
procs x threads above the cores, a thread spins while the sibling it waits for has no core; with them at or
under the cores, the figures say what PASSIVE costs a process that has the cores to itself.

    python -m cluster.bench.omp_wait [--procs 3] [--threads 2] [--iters 3000] [--width 128]
                                     [--policies default PASSIVE GOMP_SPINCOUNT=10000]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from cluster.bench.report import machine_info

WORK = """
import sys, time, torch
torch.set_num_threads(int(sys.argv[2]))
torch.manual_seed(0)
width = int(sys.argv[3])
layers = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(8)])
x = torch.randn(16, width)
t0, c0 = time.perf_counter(), time.process_time()
for _ in range(int(sys.argv[1])):
    layers(x).sum().backward()
print(f"{time.perf_counter() - t0:.2f} {time.process_time() - c0:.2f}")
"""


def run_policy(policy: str, procs: int, threads: int, iters: int, width: int = 128) -> list[tuple[float, float]]:
    """(wall s, CPU s) of each of `procs` processes started together under `policy`: "default" (neither
    OMP_WAIT_POLICY nor GOMP_SPINCOUNT set), a wait policy ("PASSIVE"), or one variable set ("GOMP_SPINCOUNT=10000")."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if "=" in policy:
        key, value = policy.split("=", 1)
        env[key] = value
    elif policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    ps = [subprocess.Popen([sys.executable, "-c", WORK, str(iters), str(threads), str(width)], env=env, stdout=subprocess.PIPE,
                           text=True) for _ in range(procs)]
    outs = [p.communicate()[0].split() for p in ps]
    if any(p.returncode for p in ps):
        raise SystemExit(f"a process failed under {policy}")
    return [(float(wall), float(cpu)) for wall, cpu in outs]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m cluster.bench.omp_wait", description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--width", type=int, default=128, help="the MLP's width: 128 as the tests' tiny models, 576 as "
                    "SmolLM2-135M's hidden size")
    ap.add_argument("--policies", nargs="+", default=["default", "PASSIVE"])
    a = ap.parse_args(argv)
    m = machine_info()
    print(f"{a.procs} process(es) x {a.threads} thread(s), {a.iters} iterations each of width {a.width}; {m['cpu_model']} "
          f"({os.cpu_count()} cores)")
    for policy in a.policies:
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        res = run_policy(policy, a.procs, a.threads, a.iters, a.width)
        walls, cpus = [w for w, _ in res], [c for _, c in res]
        print(f"  {policy if '=' in policy else 'OMP_WAIT_POLICY=' + policy:22s} wall {min(walls):7.2f}-{max(walls):7.2f} s per process, "
              f"CPU {min(cpus):7.2f}-{max(cpus):7.2f} s, all done in {time.perf_counter() - t0:7.2f} s "
              f"(load {load:.1f} before)")


if __name__ == "__main__":
    main()
