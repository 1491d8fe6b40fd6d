"""Torch threads of one process: the cores it may use (`node_cores`) and the count it computes
with (`use_threads`, applied at the start of every coarse call, because OpenMP's thread count is
per calling thread). The driver plans each actor's count: cluster/launch/thread_budget.py.
"""
from __future__ import annotations

import os

import torch

# vLLM's CPU worker replaces torch.set_num_threads with a no-op once its engine starts (it pins
# threads for its own process manager, which raygrpo does not use: the engine runs in-process).
# The binding underneath still works, so keep a reference to it taken before vLLM can patch it.
_set_torch_threads = torch._C.set_num_threads


def node_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota
    (a container limited to 2 CPUs on a 64-core host must not plan for 64)."""
    cores = len(os.sched_getaffinity(0))
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def use_threads(n: int) -> None:
    """Run this thread's torch work on n threads from now on (n <= 0: leave it as it is)."""
    if n > 0 and torch.get_num_threads() != n:
        _set_torch_threads(n)
