"""A line per costly start (a vLLM engine, a learner group, a Ray cluster), for the test suite's cost file.

The test suite's plugin (tests/suite_costs.py) sets RAYGRPO_START_LEDGER to a file of its own before
anything starts; every process started from it inherits the variable: the raylet of a cluster the tests
start, and so every Ray actor on it, and the `raygrpo` subprocesses the tests run. Where the variable is
unset (every user's run) `record_start` does nothing.

The start is recorded where the cost is paid, in the process that pays it: an engine in RolloutWorker's
constructor (so an engine Ray restarts counts again, and so do the engines the tests make directly), a
learner group in rank 0's LearnerWorker constructor (a restart of the ranks is a new group), a Ray
cluster where raygrpo or a test starts one.
"""
from __future__ import annotations

import json
import os
import sys
import time

LEDGER_ENV = "RAYGRPO_START_LEDGER"
ENGINE, LEARNER_GROUP, RAY_CLUSTER = "engine", "learner_group", "ray_cluster"
KINDS = (ENGINE, LEARNER_GROUP, RAY_CLUSTER)


def record_start(kind: str, **detail) -> None:
    """Append {"kind", "pid", "t", **detail} as one line to the ledger named by RAYGRPO_START_LEDGER, if set.

    One write of one line to a file opened with O_APPEND: lines from the many processes that share a
    ledger never interleave (a local filesystem appends each write whole). A ledger that cannot be
    written is said on stderr and never fails the start being counted."""
    path = os.environ.get(LEDGER_ENV)
    if not path:
        return
    if kind not in KINDS:
        raise ValueError(f"record_start: kind {kind!r} is none of {KINDS}")
    line = json.dumps({"kind": kind, "pid": os.getpid(), "t": round(time.time(), 3), **detail}) + "\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError as e:
        print(f"raygrpo: could not record a {kind} start in {LEDGER_ENV}={path}: {e}", file=sys.stderr, flush=True)
