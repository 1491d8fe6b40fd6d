"""learner/peak_memory.py: the step line's learner_peak_bytes counts what was allocated after the rank
started (its model), not the process's code and libraries."""
import time

from learner.peak_memory import PeakMemory, rss_bytes


def test_the_peak_counts_an_allocation_after_the_start_and_not_what_came_before():
    before = bytearray(32 * 2**20)  # held before PeakMemory starts: not counted
    before[::4096] = b"x" * len(before[::4096])
    mem = PeakMemory(on_gpu=False)
    assert mem.base >= 32 * 2**20 and abs(mem.base - rss_bytes()) < 16 * 2**20
    start = mem.peak_bytes()
    block = bytearray(96 * 2**20)
    block[::4096] = b"x" * len(block[::4096])  # touch every page: resident
    time.sleep(0.01)
    del block
    assert mem.peak_bytes() - start >= 80 * 2**20  # the freed block's high-water mark stays in the peak
    assert mem.peak_bytes() < rss_bytes() + 200 * 2**20  # and the base is taken off, not the whole process
    del before
