"""A learner rank's peak memory for its model, as the step line reports it (`learner_peak_bytes`).

On a GPU: torch's `max_memory_allocated` (what the rank's tensors ever held at once). On CPU: the
process's peak resident set (`getrusage` ru_maxrss) less its resident set just before the model
loaded, so the interpreter, torch's and DeepSpeed's own code are not counted: what is left is the
model's states, activations and the allocator's working memory, which `raygrpo plan` predicts
(cluster/plan/memory.py) and `python -m cluster.bench.plan_check` compares with this figure.
"""
from __future__ import annotations

import os
import resource

import torch


def rss_bytes() -> int:
    """This process's resident set now (/proc/self/statm's second field, in pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakMemory:
    """Construct before the model loads; `peak_bytes()` after any step."""

    def __init__(self, on_gpu: bool):
        self.on_gpu = on_gpu
        self.base = 0 if on_gpu else rss_bytes()

    def peak_bytes(self) -> float:
        if self.on_gpu:
            return float(torch.cuda.max_memory_allocated())
        # ru_maxrss is in KiB on Linux
        return float(max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self.base, 0))
