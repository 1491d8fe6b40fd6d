from __future__ import annotations

import pytest

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
