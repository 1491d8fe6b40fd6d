from __future__ import annotations

import pytest
from finished_run import finish_a_run

from cluster.launch.ray_cluster import worker_runtime_env


@pytest.fixture(scope="session")
def ray_cluster():
    """One embedded Ray cluster for the whole e2e session (starting Ray costs seconds).

    Logical CPUs exceed the 2 physical cores on purpose: actors take fractional CPUs
    and mostly wait on each other, as in the real system on a small machine.
    """
    import ray

    ray.init(num_cpus=8, include_dashboard=False, runtime_env=worker_runtime_env(), log_to_driver=True)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory, tiny_model_dir):
    """(the user's directory, the run dir, its console) of one finished CLI run, shared by the tests that read
    a finished run (tests/e2e/finished_run.py); a test that changes it works on a copy."""
    return finish_a_run(tmp_path_factory.mktemp("user"), tiny_model_dir)
