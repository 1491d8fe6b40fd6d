"""actors/runtime/start_up.py: start-up runs without full garbage collections, and the process's own
thresholds come back afterwards."""
from __future__ import annotations

import gc
import inspect
import json
import os
import subprocess
import sys

import pytest

from actors.runtime.start_up import few_full_collections, starts_with_few_full_collections
from cluster.driver.startup import load_inputs, start_actors
from cluster.run import logs


def full_collections_while(work) -> int:
    """How many generation-2 collections CPython ran while `work()` ran."""
    seen = []

    def count(phase, info):
        if phase == "start" and info["generation"] == 2:
            seen.append(1)
    gc.callbacks.append(count)
    try:
        work()
    finally:
        gc.callbacks.remove(count)
    return len(seen)


def build_long_lived():
    """What an import does to the collector: many container objects, all kept. (CPython runs a full
    collection only once the survivors since the last one reach a quarter of the objects it already
    keeps: half as many again as this process tracks is sure to get there.)"""
    return [[i] for i in range(max(300_000, len(gc.get_objects()) // 2))]


@pytest.fixture
def default_thresholds():
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # CPython's defaults: whatever this process had set, the test starts from them
    yield
    gc.set_threshold(*before)


def test_an_import_sized_start_runs_no_full_collection_and_the_thresholds_come_back(default_thresholds):
    kept = []
    assert full_collections_while(lambda: kept.append(build_long_lived())) > 0  # the cost being removed
    with few_full_collections():
        assert gc.get_threshold()[:2] == (700, 10)  # the young generations are still collected
        assert full_collections_while(lambda: kept.append(build_long_lived())) == 0
    assert gc.get_threshold() == (700, 10, 10)


def test_the_thresholds_come_back_when_the_start_fails_and_a_higher_one_is_kept(default_thresholds):
    with pytest.raises(RuntimeError), few_full_collections():
        raise RuntimeError("the model could not load")
    assert gc.get_threshold() == (700, 10, 10)
    gc.set_threshold(700, 10, 5_000)  # a process that had held them back further keeps its own setting
    with few_full_collections():
        assert gc.get_threshold() == (700, 10, 5_000)
    assert gc.get_threshold() == (700, 10, 5_000)


def test_a_decorated_constructor_keeps_the_signature_ray_reads(default_thresholds):
    class Actor:
        @starts_with_few_full_collections
        def __init__(self, model_path: str, *, rank: int = 0):
            self.seen = gc.get_threshold()

    assert list(inspect.signature(Actor.__init__).parameters) == ["self", "model_path", "rank"]
    assert Actor("m", rank=1).seen == (700, 10, 1_000)
    assert gc.get_threshold() == (700, 10, 10)


def test_the_driver_starts_with_few_full_collections():
    # the driver's two start-up steps (the actors' constructors are decorated the same way; their modules
    # import vLLM or DeepSpeed, which the unit tier does not)
    for step in (load_inputs, start_actors):
        assert step.__wrapped__.__name__ == step.__name__ and step.__code__ is not step.__wrapped__.__code__


# A Ray worker process of a run, as Ray starts it: the set-up hook, then the actor's module and its constructor,
# then a later start-up step (a learner rank's weight-sync set-up).
WORKER = """
import gc, json
from actors.runtime.start_up import starts_with_few_full_collections
from cluster.run.logs import setup_worker
gc.set_threshold(700, 10, 10)
setup_worker()
seen = {"after_hook": gc.get_threshold()}
class Actor:
    @starts_with_few_full_collections
    def __init__(self):
        seen["constructing"] = gc.get_threshold()
    @starts_with_few_full_collections
    def init_weight_sync(self):
        seen["later_step"] = gc.get_threshold()
actor = Actor()
seen["started"] = gc.get_threshold()
actor.init_weight_sync()
seen["after_later_step"] = gc.get_threshold()
print(json.dumps(seen))
"""


@pytest.mark.parametrize("level", ["WARNING", "INFO"])
def test_a_ray_worker_holds_them_from_its_hook_until_its_actor_has_started(level, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAYGRPO_")}
    env |= {logs.LEVEL_ENV: level, logs.LOG_DIR_ENV: str(tmp_path / "logs")}
    out = subprocess.run([sys.executable, "-c", WORKER], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    # quiet: the hook sent fd 1 to the log file and printing goes through its console copy; either way one line
    seen = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
    assert seen == {"after_hook": [700, 10, 1_000], "constructing": [700, 10, 1_000], "started": [700, 10, 10],
                    "later_step": [700, 10, 1_000], "after_later_step": [700, 10, 10]}, seen
