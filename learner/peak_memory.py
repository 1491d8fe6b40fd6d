"""A learner rank's peak memory for its model, as the step line reports it (`learner_peak_bytes`).

On a GPU: torch's `max_memory_allocated` (what the rank's tensors ever held at once). On CPU: the
process's peak resident set (VmHWM, its high-water mark, reset when the count starts) less its resident
set just before the model loaded, so the interpreter, torch's and DeepSpeed's own code are not counted:
what is left is the model's states, activations and the allocator's working memory, which `raygrpo plan`
predicts (cluster/plan/memory.py) and `python -m cluster.bench.plan_check` compares with this figure.
"""
from __future__ import annotations

import os
import resource

import torch


def rss_bytes() -> int:
    """This process's resident set now (/proc/self/statm's second field, in pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """This process's resident high-water mark: /proc/self/status VmHWM, the memory's own mark, which
    reset_peak_rss resets. Not getrusage's ru_maxrss where VmHWM can be read: it also keeps the mark of the
    memory the process had before its exec, which for a child of a large process (a subprocess of a pytest
    worker) is its parent's resident set: the figure read 0 (2026-11-29)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def reset_peak_rss() -> bool:
    """This process's resident high-water mark (VmHWM) set to its resident set now: Linux's /proc/self/clear_refs
    "5". Without it a peak from before (importing torch and DeepSpeed, a checkpoint read) hides the model's own:
    the peak then stays at the old mark and the figure reads 0. False where it cannot (not Linux, a kernel or
    sandbox that refuses)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """Construct before the model loads; `peak_bytes()` after any step."""

    def __init__(self, on_gpu: bool):
        self.on_gpu = on_gpu
        if not on_gpu:
            reset_peak_rss()
        self.base = 0 if on_gpu else rss_bytes()

    def peak_bytes(self) -> float:
        if self.on_gpu:
            return float(torch.cuda.max_memory_allocated())
        return float(max(peak_rss_bytes() - self.base, 0))
