"""learner/peak_memory.py: the step line's learner_peak_bytes counts what was allocated after the rank
started (its model), not the process's code and libraries.

In a fresh Python process, as a learner rank is (a Ray actor's own process): the CPU peak is the process's
resident high-water mark. It only rises: a peak before the count starts (here a freed 256 MB block; in a rank,
importing torch and DeepSpeed) hid the allocations after it until PeakMemory reset the mark when it starts
(learner/peak_memory.py reset_peak_rss; the figure read 0 in `make test`, 2026-11-29)."""
import subprocess
import sys
import textwrap

MEASURE = textwrap.dedent("""
    import time
    from learner.peak_memory import PeakMemory, rss_bytes

    gone = bytearray(256 * 2**20)  # a peak before PeakMemory starts (importing torch, reading a checkpoint)
    gone[::4096] = b"x" * len(gone[::4096])
    del gone
    before = bytearray(32 * 2**20)  # held before PeakMemory starts: not counted
    before[::4096] = b"x" * len(before[::4096])
    mem = PeakMemory(on_gpu=False)
    assert mem.base >= 32 * 2**20 and abs(mem.base - rss_bytes()) < 16 * 2**20, (mem.base, rss_bytes())
    start = mem.peak_bytes()
    block = bytearray(96 * 2**20)
    block[::4096] = b"x" * len(block[::4096])  # touch every page: resident
    time.sleep(0.01)
    del block
    grown = mem.peak_bytes() - start
    # the freed block's high-water mark stays in the peak, and the higher one from before the start does not hide it
    assert grown >= 80 * 2**20, grown
    assert mem.peak_bytes() < rss_bytes() + 200 * 2**20, (mem.peak_bytes(), rss_bytes())  # the base is taken off
    print("ok", grown)
""")


def test_the_peak_counts_an_allocation_after_the_start_and_not_what_came_before():
    out = subprocess.run([sys.executable, "-c", MEASURE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-3000:]
