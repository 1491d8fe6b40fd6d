"""A process's start-up with Python's full garbage collections held back.

An engine's start imports vLLM, torch and transformers; a learner rank's, DeepSpeed, torch and
transformers; the driver's, torch and transformers. That is millions of objects, and all of them live
as long as the process. CPython runs a full collection (a walk over every tracked object) each time
ten young collections have passed and enough objects have survived them, and each walk is longer than
the one before. None finds garbage worth that time, since the imports keep what they make. The actors'
constructors, a learner rank's weight-sync set-up (its first call imports vLLM's transfer API) and the
driver's start therefore run with the full collections' threshold raised. Young collections still run
as before, so short-lived cycles are still freed. The process's own thresholds come back afterwards.

Measured on a 2-core AMD EPYC, in a 1-step `raygrpo train` of the tiny model (CPU time inside full
collections, from gc.callbacks): an engine's start ran 11 of them, 3.8-4.3 CPU-s, and now runs the 3 that
vLLM's own freeze_gc_heap asks for, 1.5-2.2 CPU-s. A learner rank's went from 7 (1.4-1.6 CPU-s) to 1
(0.3), and the driver's from 7 (1.1 CPU-s) to none. docs/STATUS.md has the rest.
"""
from __future__ import annotations

import functools
import gc
from contextlib import contextmanager

# A full collection after every 1,000th young (generation-1) collection instead of every 10th:
# none during start-up, and a process that runs longer still gets them.
FULL_COLLECTION_EVERY = 1_000


# The thresholds a Ray worker process started with, while hold_until_started holds them back (else None).
_held_since_start: tuple[int, int, int] | None = None


def _held(thresholds: tuple[int, int, int]) -> tuple[int, int, int]:
    return thresholds[0], thresholds[1], max(thresholds[2], FULL_COLLECTION_EVERY)


def hold_until_started() -> None:
    """Called by Ray's worker set-up hook (cluster/run/logs.py setup_worker) in every worker process
    of a run, before Ray imports the actor's module and torch with it (3 full collections, 0.5-0.9 CPU-s
    per actor). The actor's decorated constructor gives the thresholds back."""
    global _held_since_start
    if _held_since_start is None:
        _held_since_start = gc.get_threshold()
        gc.set_threshold(*_held(_held_since_start))


@contextmanager
def few_full_collections():
    """The block runs with full collections held back (see the module docstring). Afterwards, even when
    it raises, the thresholds that were set before it come back, or the ones the process started with
    when hold_until_started held them."""
    global _held_since_start
    before = gc.get_threshold() if _held_since_start is None else _held_since_start
    _held_since_start = None
    gc.set_threshold(*_held(before))
    try:
        yield
    finally:
        gc.set_threshold(*before)


def starts_with_few_full_collections(init):
    """Decorates an actor's `__init__` (its imports and model loading) with few_full_collections.
    functools.wraps keeps the signature that Ray reads."""
    @functools.wraps(init)
    def start(*args, **kwargs):
        with few_full_collections():
            return init(*args, **kwargs)
    return start
