"""Running untrusted programs (code rewards) in an OS-level sandbox: the isolation levels, one module each.

    strict     fresh user/network/mount/pid namespaces, a built root, no capabilities   strict.py
    process    a process group, rlimits, a temp dir, a scrubbed environment (weaker)    process.py

`probe(name)` says why a level cannot be had on this machine (None: it can), by running a trivial program
through it; the caller refuses to start rather than take a weaker level. runner.py runs one program;
harness.py is what runs inside.
"""
from __future__ import annotations

from actors.runtime.sandbox.process import ProcessLevel
from actors.runtime.sandbox.runner import Level, Limits, run_program
from actors.runtime.sandbox.strict import StrictLevel

LEVELS: dict[str, Level] = {level.name: level for level in (StrictLevel(), ProcessLevel())}
PROBE_LIMITS = Limits(timeout_s=10.0, memory_mb=256, output_bytes=4096)


def probe(name: str) -> str | None:
    """Why the level `name` cannot run a program here (None: a trivial program passed its test in it)."""
    level = LEVELS[name]
    missing = level.missing()
    if missing:
        return missing
    try:
        got = run_program(level, "x = 1", ["assert x == 1"], PROBE_LIMITS)
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None if got[0]["outcome"] == "passed" else got[0]["detail"]
