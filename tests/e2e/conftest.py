from __future__ import annotations

import os

import pytest
import torch
from engine_pool import EnginePool
from finished_run import finish_a_run, once_for_the_session
from pool_scope import PoolFilesTogether, uses_the_pool

from actors.runtime.start_ledger import RAY_CLUSTER, record_start
from cluster.launch.ray_cluster import worker_runtime_env


@pytest.fixture(scope="session", autouse=True)
def _test_process_threads_shared_among_workers():
    """The test process's own torch work (the in-process driver, the models the tests load to check a
    run against: SmolLM2's GGUF check, transformers beside vLLM) on its share of the cores. `make test`
    runs two pytest workers on two cores, each beside its own run's actors; torch's default of a thread
    per core put OpenMP threads that spin at their barriers on cores already busy (tests/unit/conftest.py:
    a tiny model's forward 2.0 s on 2 threads beside another job, 0.13 s on 1). Only this process: no
    environment variable is set, so `raygrpo` subprocesses, Ray and its actors get what a user gets."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
    yield
    torch.set_num_threads(before)


@pytest.fixture
def no_tf32():
    """float32 on a GPU as on a CPU, for the GPU tests that compare the two: TF32 matmuls and convolutions
    would round to 10-bit mantissas."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.fixture(scope="session")
def ray_cluster():
    """One embedded Ray cluster for the whole e2e session (starting Ray costs seconds).

    Logical CPUs exceed the 2 physical cores on purpose: actors take fractional CPUs
    and mostly wait on each other, as in the real system on a small machine.
    """
    import ray

    # No idle workers prestarted (cluster/launch/ray_cluster.py NODE_START_ENV: as raygrpo's own clusters; as a
    # system config here, so that no variable reaches the CLI runs this process starts)
    ray.init(num_cpus=8, include_dashboard=False, runtime_env=worker_runtime_env(), log_to_driver=True,
             _system_config={"prestart_worker_first_driver": False})
    record_start(RAY_CLUSTER, how="the e2e session's cluster")  # the suite's cost file (tests/suite_costs.py)
    yield ray
    ray.shutdown()


LIVE_POOL = pytest.StashKey[EnginePool]()  # the session's pool, for the hook below that stops its engines


@pytest.fixture(scope="session")
def engine_pool(ray_cluster, request):
    """Warm RolloutWorker engines shared by the engine-level files (tests/e2e/engine_pool.py): each lease is checked
    clean (base weights at version 0, the config it started with) and put back so; one pool per pytest process, its
    engines started when first leased. Under `make test` one xdist worker runs every file that uses it
    (pytest_xdist_make_scheduler below)."""
    pool = EnginePool(ray_cluster)
    request.config.stash[LIVE_POOL] = pool
    yield pool
    pool.close()


@pytest.hookimpl(trylast=True)  # last: after pytest's own teardown, which gave the ending file's leases back
def pytest_runtest_teardown(item, nextitem):
    """The pool's engines stopped once the files that use it are done: they run together (pool_scope.py), and each
    idle engine still takes 3-4% of a core (most of it the gloo loop threads of vLLM's process groups), through
    the rest of the worker's session (~500 s of a full suite). A later lease would start its engines again."""
    pool = item.config.stash.get(LIVE_POOL, None)
    if pool is None or not uses_the_pool(str(item.path)):
        return
    if nextitem is None or not uses_the_pool(str(nextitem.path)):
        pool.close()


@pytest.hookimpl(optionalhook=True, tryfirst=True)  # optional: absent under -p no:xdist; first: before xdist's own
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile (`make test`), except that the files using `engine_pool` are one unit of work: one worker
    runs them, and the pool's engines start once, not once per worker (tests/e2e/pool_scope.py)."""
    if config.getvalue("dist") != "loadfile":
        return None
    return PoolFilesTogether(config, log)


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory, tiny_model_dir):
    """(the user's directory, the run dir, its console) of one finished CLI run, shared by the tests that read
    a finished run (tests/e2e/finished_run.py); a test that changes it works on a copy. Under pytest-xdist
    (`make test`) its users run in two workers: the run is made once for the session, in the directory the
    workers' temporary directories share, and read by both."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:  # one pytest process: this session's own run
        return finish_a_run(tmp_path_factory.mktemp("user"), tiny_model_dir)
    return once_for_the_session(tmp_path_factory.getbasetemp().parent, tiny_model_dir)
