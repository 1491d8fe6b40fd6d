"""A process's start-up with Python's full garbage collections held back.

An engine's start imports vLLM, torch and transformers; a learner rank's, DeepSpeed, torch and
transformers; the driver's, torch and transformers. That is millions of objects, and all of them live
as long as the process. CPython runs a full collection (a walk over every tracked object) each time
ten young collections have passed and enough objects have survived them, so the walks come more and
more often as the heap grows, and each is longer than the one before: 9 of them during an engine's
imports, 0.3-0.6 s each near the end. None finds garbage worth that time, since the imports keep what
they make. The actors' constructors, a learner rank's weight-sync set-up (its first call imports
vLLM's transfer API) and the driver's start therefore run with the full collections' threshold
raised. Young collections still run as before, so short-lived cycles are still freed. The process's
own thresholds come back afterwards.

Measured on a 2-core AMD EPYC: `from vllm import LLM`, transformers' AutoModelForCausalLM and DeepSpeed
went from 17.0-17.2 to 12.2-14.9 CPU-s. The per-process figures of a whole run are in docs/STATUS.md.
"""
from __future__ import annotations

import functools
import gc
from contextlib import contextmanager

# A full collection after every 1,000th young (generation-1) collection instead of every 10th:
# none during start-up, and a process that runs longer still gets them.
FULL_COLLECTION_EVERY = 1_000


@contextmanager
def few_full_collections():
    """The block runs with full collections held back (see the module docstring); the thresholds that
    were set before come back after it, even when it raises."""
    before = gc.get_threshold()
    gc.set_threshold(before[0], before[1], max(before[2], FULL_COLLECTION_EVERY))
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
