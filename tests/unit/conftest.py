"""The unit tier shares one interpreter with the e2e tier (`pytest tests/unit tests/e2e`): a unit test that
calls product code which sets the driver's environment (ray.network_interface sets GLOO_SOCKET_IFNAME, the
auth check sets RAY_AUTH_MODE) must not change what the e2e runs after it inherit."""
import os
import sys
from pathlib import Path

import pytest
import torch

# The cores shared out among the pytest processes. `make test` runs this tier in two xdist workers on two
# cores, and torch's default (a thread per core in each) put four busy OpenMP threads on two cores, whose
# barriers then spin against each other: the tiny model's forward took 2.0 s on 2 threads beside another
# job, 0.13 s on 1. Tests that need a count set it themselves (the warm start's and the policy reward's
# `threads`) and restore it. Per test, restored after, so the e2e tests of a shared session are untouched.
_THREADS = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


@pytest.fixture(autouse=True)
def _threads_shared_among_workers():
    before = torch.get_num_threads()
    torch.set_num_threads(_THREADS)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _environment_restored():
    before = dict(os.environ)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)  # the same share for the processes a test starts
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


# What this process's collection loaded, taken before any test ran: the modules it collected (selected by
# -k or not: each was imported), and whether vllm was among the modules loaded by then
# (tests/unit/test_import_cost.py).
_COLLECTED: dict = {"paths": set()}


def pytest_itemcollected(item):
    _COLLECTED["paths"].add(Path(item.path))


def pytest_collection_finish(session):
    _COLLECTED["vllm"] = "vllm" in sys.modules
    # test modules of another tier collected beside this one (`pytest tests/unit tests/e2e`): what loaded vllm
    # is then not this tier's business, and the import-cost test collects the tier alone instead
    unit = Path(__file__).resolve().parent
    files = (Path(f) for f in (getattr(m, "__file__", None) for m in list(sys.modules.values())) if f)
    _COLLECTED["others"] = any(f.name.startswith("test_") and unit.parent in f.parents and f.parent != unit for f in files)


@pytest.fixture
def collection_of_this_session() -> dict:
    """{"paths": the unit test modules this pytest process collected, "vllm": whether collecting loaded vllm,
    "others": whether test modules of another tier were collected too}."""
    return {"paths": frozenset(_COLLECTED["paths"]), "vllm": _COLLECTED.get("vllm"), "others": _COLLECTED.get("others", True)}
