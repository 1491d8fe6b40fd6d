"""Starting or joining a Ray cluster, and the environment every Ray worker gets."""
from __future__ import annotations

import os

from cluster.launch.auth import explain_auth_failure, gcs_auth_mode, resolve_gcs_address, use_cluster_auth_mode

# Set in every Ray worker process. No hub access anywhere; keep tokenizers single-threaded so
# several actors share a small machine without oversubscribing its cores.
WORKER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

# Every Ray node raygrpo starts (the embedded cluster here; the test clusters, docker/compose.yaml,
# docker/slurm.sbatch) gets these. The raylet gives its dashboard agent 30 s to register (Ray's
# default) and then dies with "Timed out waiting for file .../dashboard_agent_listen_port_..."; on a
# loaded machine the agent's start (imports, a Python per agent) takes longer. README says the same
# to users who start nodes themselves.
NODE_START_ENV = {"RAY_agent_register_timeout_ms": "300000"}


def worker_runtime_env(extra_env: dict[str, str] | None = None, more: dict | None = None) -> dict:
    """The runtime env of every Ray worker of a run. `more`: further runtime-env fields, its env_vars
    added to ours (the run's console set-up, cluster/run/logs.py worker_env)."""
    env = {k: os.environ.get(k, v) for k, v in WORKER_ENV.items()}
    env.update(extra_env or {})
    more = more or {}
    return {**more, "env_vars": {**env, **more.get("env_vars", {})}}


def start_ray(address: str, num_cpus: int, runtime_env: dict | None = None) -> None:
    """Join `address` ("auto" or HOST:PORT), or start an embedded local cluster sized to the machine.
    `runtime_env`: what the workers get besides WORKER_ENV (see worker_runtime_env)."""
    import ray

    if ray.is_initialized():
        return
    if address:
        join_cluster(address, runtime_env)
        return
    # Logical CPUs: at least 8 so that fractional actors fit on a 2-core machine; they mostly
    # wait on each other, and each limits its own threads.
    cpus = num_cpus or max(8, os.cpu_count() or 1)
    print(f"starting an embedded Ray cluster ({cpus} logical CPUs; ray.address joins a running one)", flush=True)
    for k, v in NODE_START_ENV.items():  # the raylet ray.init starts reads it from this environment
        os.environ.setdefault(k, v)
    ray.init(num_cpus=cpus, include_dashboard=False, runtime_env=worker_runtime_env(more=runtime_env), log_to_driver=True)


def join_cluster(address: str, runtime_env: dict | None = None) -> None:
    """Connect this driver to a running cluster ("auto" or HOST:PORT of its GCS) in the cluster's
    authentication mode (token discovery as `submit`: cluster/launch/auth.py)."""
    import ray

    gcs = resolve_gcs_address(address)
    use_cluster_auth_mode(gcs_auth_mode(gcs), gcs)
    try:
        ray.init(address=gcs, runtime_env=worker_runtime_env(more=runtime_env), log_to_driver=True)
    except Exception as e:
        raise (explain_auth_failure(e, gcs) or e) from e
