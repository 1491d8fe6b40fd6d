"""Starting or joining a Ray cluster, and the environment every Ray worker gets."""
from __future__ import annotations

import contextlib
import os
import sys
import time

import psutil

from actors.runtime.start_ledger import RAY_CLUSTER, record_start
from cluster.launch.auth import (
    explain_auth_failure,
    gcs_auth_mode,
    keep_token_private,
    resolve_gcs_address,
    use_cluster_auth_mode,
)

# Set in every Ray worker process. No hub access anywhere; keep tokenizers single-threaded so
# several actors share a small machine without oversubscribing its cores.
WORKER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

# The variables that pin the interface gloo and NCCL use: the driver's reach every actor
# (ray.network_interface sets both: pin_network_interface).
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")

# Every Ray node raygrpo starts (the embedded cluster here; the test clusters, docker/compose.yaml,
# docker/slurm.sbatch) gets these.
# - The raylet gives its dashboard agent 30 s to register (Ray's default) and then dies with "Timed out
#   waiting for file .../dashboard_agent_listen_port_..."; on a loaded machine the agent's start (imports,
#   a Python per agent) takes longer. README says the same to users who start nodes themselves.
# - When the first driver connects, the raylet starts idle Python workers for tasks without a runtime env
#   (`prestart_worker_first_driver`; 2 on a 2-core machine, ~1.4 CPU-s each). Every actor of a run has the
#   run's runtime env (worker_runtime_env), so none of them is ever used: they only cost each start CPU.
NODE_START_ENV = {"RAY_agent_register_timeout_ms": "300000", "RAY_prestart_worker_first_driver": "0"}

# An embedded cluster is one machine's, so Ray's GCS, raylet, agents and every worker's gRPC server listen on
# 127.0.0.1 only (issue 59: all on * / 0.0.0.0 before). Ray binds them to the node's IP, and turns a 127.0.0.1
# given as `_node_ip_address` into the machine's reachable IP (services.resolve_ip_for_localhost); it takes the
# loopback as the node's IP only where its clusters are off: RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, its default on
# macOS and Windows (ray_constants.ENABLE_RAY_CLUSTER, read at import: set for the nodes ray.init starts, which
# pass it to every worker). A joined cluster is left as its nodes were started.
LOOPBACK_ONLY_ENV = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def worker_runtime_env(extra_env: dict[str, str] | None = None, more: dict | None = None) -> dict:
    """The runtime env of every Ray worker of a run. `more`: further runtime-env fields, its env_vars
    added to ours (the run's console set-up, cluster/run/logs.py worker_env)."""
    env = {k: os.environ.get(k, v) for k, v in WORKER_ENV.items()}
    env.update({k: os.environ[k] for k in SOCKET_IFNAME_VARS if os.environ.get(k)})
    env.update(extra_env or {})
    more = more or {}
    return {**more, "env_vars": {**env, **more.get("env_vars", {})}}


def embedded_cluster(address: str) -> bool:
    """Whether start_ray(address) starts a cluster of its own on this host (else it joins one: ray.address, or
    RAY_ADDRESS as in a `ray job submit` job)."""
    return not address and not os.environ.get("RAY_ADDRESS")


def pin_network_interface(interface: str, embedded: bool = False) -> None:
    """ray.network_interface: set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME in the driver, from where
    they reach every actor (worker_runtime_env). "": leave the driver's own as they are. `embedded`: every actor
    runs on this host, so the interface must exist here; refused naming the key and this host's interfaces, where
    gloo would fail later in C++ ("Unable to find address") without naming it (issue 59)."""
    if interface and embedded and interface not in psutil.net_if_addrs():
        raise ValueError(f"ray.network_interface={interface!r}: this host has no such network interface (it has "
                         f"{', '.join(sorted(psutil.net_if_addrs()))}); name one of them, or leave the key empty")
    if interface:
        for k in SOCKET_IFNAME_VARS:
            os.environ[k] = interface


def start_ray(address: str, num_cpus: int, runtime_env: dict | None = None) -> None:
    """Join `address` ("auto" or HOST:PORT), or start an embedded local cluster sized to the machine.
    `runtime_env`: what the workers get besides WORKER_ENV (see worker_runtime_env)."""
    import ray

    if ray.is_initialized():
        return
    if not address and os.environ.get("RAY_ADDRESS"):
        # Ray sets RAY_ADDRESS in the driver of a `ray job submit` job (and users export it): that is the
        # cluster meant. Starting an embedded one there would fail in Ray ("When connecting to an existing
        # cluster, num_cpus and num_gpus must not be provided").
        address = os.environ["RAY_ADDRESS"]
        print(f"ray.address is empty and RAY_ADDRESS={address} is set (as in a `ray job submit` job): joining that "
              "cluster (set ray.address to say so in the config)", flush=True)
    if address:
        join_cluster(address, runtime_env)
        return
    # Logical CPUs: at least 8 so that fractional actors fit on a 2-core machine; they mostly
    # wait on each other, and each limits its own threads.
    cpus = num_cpus or max(8, os.cpu_count() or 1)
    print(f"starting an embedded Ray cluster ({cpus} logical CPUs; ray.address joins a running one)", flush=True)
    for k, v in NODE_START_ENV.items():  # the raylet ray.init starts reads it from this environment
        os.environ.setdefault(k, v)
    before = child_pids()

    def cleanup():
        ray.shutdown()
        # Ray raises inside its Node's constructor, so ray.shutdown() knows nothing of the GCS and raylet
        # that attempt started: stop them (this process's new children), or each retry leaves two more.
        stop_processes(child_pids() - before)

    # address="local": a new cluster even where `ray start` left one behind on this machine, which
    # ray.init() with no address would join (and then refuse num_cpus).
    with loopback_only():
        start_with_retries(lambda: ray.init(address="local", num_cpus=cpus, include_dashboard=False,
                                            runtime_env=worker_runtime_env(more=runtime_env), log_to_driver=True),
                           cleanup)
    keep_token_private()  # the token ray.init may just have written
    record_start(RAY_CLUSTER, how="embedded")  # the test suite's cost file; a no-op in a user's run


@contextlib.contextmanager
def loopback_only():
    """While the embedded cluster starts: Ray takes 127.0.0.1 as this node's IP (LOOPBACK_ONLY_ENV), unless the
    user set that variable."""
    from ray._private import ray_constants

    name, value = LOOPBACK_ONLY_ENV
    if name in os.environ:
        yield
        return
    was = ray_constants.ENABLE_RAY_CLUSTER
    os.environ[name], ray_constants.ENABLE_RAY_CLUSTER = value, False
    try:
        yield
    finally:
        os.environ.pop(name, None)
        ray_constants.ENABLE_RAY_CLUSTER = was


def child_pids() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def stop_processes(pids: set[int], grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after grace_s, the processes `pids` (those still there)."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
            procs[-1].terminate()
        except psutil.Error:
            continue
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass


# Ray gives its raylet a fixed 30 s to register with the GCS (ray/_private/node.py); on a busy machine
# (load averages of 15-38 seen) it misses that now and then, and the same start works a moment later.
START_ATTEMPTS = 3
START_RETRY_PAUSE_S = 5.0
STARTUP_TIMEOUT = ("timed out during startup", "failed to startup", "GCS has become overloaded")


class RayStartFailed(RuntimeError):
    """The embedded Ray cluster did not start, after the retries."""


def is_startup_timeout(e: BaseException) -> bool:
    return any(t in str(e) for t in STARTUP_TIMEOUT)


def start_with_retries(start, cleanup, attempts: int = START_ATTEMPTS, pause_s: float = START_RETRY_PAUSE_S,
                       say=None, sleep=time.sleep):
    """start() (ray.init of the embedded cluster), retried when Ray's own start-up timed out (the reason
    printed each time; cleanup() between tries); after the last try a RayStartFailed that says it was Ray's
    start-up and what to do. Any other error is raised at once."""
    say = say or (lambda text: print(text, file=sys.stderr, flush=True))
    for attempt in range(1, attempts + 1):
        try:
            return start()
        except Exception as e:
            if not is_startup_timeout(e):
                raise
            reason = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            try:
                cleanup()
            except Exception:  # noqa: BLE001 - a half-started cluster: the next try starts afresh anyway
                pass
            if attempt == attempts:
                raise RayStartFailed(
                    f"Ray's own start-up timed out {attempts} times (Ray: {reason}; load average "
                    f"{_load()}): Ray gives its raylet a fixed 30 s to register, which a busy machine can miss. Nothing "
                    "of the run was started or lost. Run the same command again when the machine is less loaded, or "
                    "start Ray once by hand (`ray start --head`) and pass ray.address=auto, so each run joins it") from e
            say(f"Ray's start-up timed out (attempt {attempt} of {attempts}; Ray: {reason}; load average {_load()}): "
                f"a busy machine; starting it again in {pause_s:.0f}s")
            sleep(pause_s)


def _load() -> str:
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "unknown"


def join_cluster(address: str, runtime_env: dict | None = None) -> None:
    """Connect this driver to a running cluster ("auto" or HOST:PORT of its GCS) in the cluster's
    authentication mode (token discovery as `submit`: cluster/launch/auth.py)."""
    import ray

    gcs = resolve_gcs_address(address)
    # said before ray.init, as the embedded start is: on a busy machine joining takes tens of seconds
    print(f"joining the Ray cluster at {gcs}", flush=True)
    use_cluster_auth_mode(gcs_auth_mode(gcs), gcs)
    try:
        ray.init(address=gcs, runtime_env=worker_runtime_env(more=runtime_env), log_to_driver=True)
    except Exception as e:
        raise (explain_auth_failure(e, gcs) or e) from e
    keep_token_private()
