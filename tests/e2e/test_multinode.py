"""A real two-node Ray cluster on one machine: a head and a worker node joined to it, each a
separate raylet with its own resources; `raygrpo submit` sends a training run through the
Job Submission API to the head's dashboard; the actors must land on both nodes.

Every server is reachable on loopback only: Ray's GCS and raylets listen on all interfaces
(Ray has no option to bind them to one), so the nodes and the submitting client run in a
network namespace that holds nothing but `lo` (root is needed for that; without it the test
runs in the host's namespace with every address set to 127.0.0.1). Both nodes are stopped at
the end, even on failure; each has its own temp dir, so that never touches another Ray here.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from actors.runtime.sockets import free_port
from cluster.launch.ray_cluster import NODE_START_ENV

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


# A user's environment: no RAY_* variable, the venv not on PATH (its `ray` is called by path). The head
# then runs with token authentication (Ray 2.60 does whenever ~/.ray/auth_token exists), and
# `raygrpo submit` must find the token and the cluster's Python by itself.
ENV = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
ENV["PATH"] = os.pathsep.join(p for p in ENV.get("PATH", "/usr/bin:/bin").split(os.pathsep)
                              if p and Path(p).resolve() != BIN.resolve())
# A node joining a token-authenticated head needs RAY_AUTH_MODE=token (Ray 2.60 switches it on by
# itself only for a head and for ray.init; Ray's docs: "configured consistently on every node").
WORKER_NODE_ENV = {**ENV, "RAY_AUTH_MODE": "token"}


@pytest.fixture
def netns():
    """A fresh network namespace with only loopback, or None where we may not make one."""
    name = f"raygrpo-mn-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    if made and subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"]).returncode == 0:
        yield ["ip", "netns", "exec", name]
    else:
        yield []
    if made:
        subprocess.run(["ip", "netns", "del", name], check=False)


def ray_start(prefix: list[str], args: list[str], temp_dir: str, log, env: dict = ENV) -> subprocess.Popen:
    return subprocess.Popen([*prefix, str(BIN / "ray"), "start", "--block", f"--temp-dir={temp_dir}",
                             "--disable-usage-stats", *args],
                            env={**env, **NODE_START_ENV}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop_node(proc: subprocess.Popen, temp_dir: str) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=20)
            break
        except subprocess.TimeoutExpired:
            continue
    # raylet, gcs, dashboard & workers carry the node's temp dir in their command lines
    subprocess.run(["pkill", "-9", "-f", temp_dir], check=False)


def wait_for_nodes(prefix: list[str], address: str, n: int, timeout_s: float = 180) -> None:
    probe = ("import sys; from cluster.launch.auth import dashboard_auth_mode, use_cluster_auth_mode; "
             f"use_cluster_auth_mode(dashboard_auth_mode('{address}'), '{address}'); "
             "from ray.util.state import list_nodes; "
             f"sys.exit(0 if len(list_nodes(address='{address}', filters=[('state', '=', 'ALIVE')])) >= {n} else 1)")
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if subprocess.run([*prefix, sys.executable, "-c", probe], env=ENV, cwd=ROOT, capture_output=True).returncode == 0:
            return
        time.sleep(3)
    raise TimeoutError(f"{n} Ray nodes did not come up at {address} within {timeout_s}s")


@pytest.mark.timeout(900)
def test_submit_to_a_two_node_cluster(tiny_model_dir, tmp_path, netns):
    gcs_port, dash_port = free_port(), free_port()
    address = f"http://127.0.0.1:{dash_port}"
    head_tmp = tempfile.mkdtemp(prefix="rg-head-")
    worker_tmp = tempfile.mkdtemp(prefix="rg-node2-")
    log = open(tmp_path / "ray_nodes.log", "w")
    head = ray_start(netns, ["--head", "--node-ip-address=127.0.0.1", f"--port={gcs_port}", "--dashboard-host=127.0.0.1",
                      f"--dashboard-port={dash_port}", "--include-dashboard=true", "--num-cpus=3",
                      f"--ray-client-server-port={free_port()}"], head_tmp, log)
    worker = None
    try:
        wait_for_nodes(netns, address, 1)
        worker = ray_start(netns, [f"--address=127.0.0.1:{gcs_port}", "--node-ip-address=127.0.0.1", "--num-cpus=3",
                            '--resources={"second_node": 1}'], worker_tmp, log, env=WORKER_NODE_ENV)
        wait_for_nodes(netns, address, 2)
        run_dir = tmp_path / "run"
        out = subprocess.run(
            [*netns, str(BIN / "raygrpo"), "submit", "examples/cpu_demo.yaml", "--address", address,
             f"model.path={tiny_model_dir}", f"trainer.run_dir={run_dir}", "trainer.steps=2",
             "trainer.prompts_per_step=4", "trainer.group_size=4", "data.num_eval=4", "data.task_digits=1",
             "rollout.num_workers=2", "rollout.max_model_len=48", "rollout.max_new_tokens=6",
             "rollout.gpu_memory_utilization=0.03", "learner.num_ranks=2", "learner.zero_stage=3",
             "metrics.tensorboard=false", "checkpoint.every=0", "ray.strategy=SPREAD"],
            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=800)
        print(out.stdout[-5000:], out.stderr[-3000:])
        assert out.returncode == 0, out.stderr[-3000:]
        assert "submitted job" in out.stdout and "SUCCEEDED" in out.stdout
        assert f"driver runs on {BIN / 'python'}" in out.stdout  # the cluster's Python, not the first on PATH
        placement = json.loads((run_dir / "placement.json").read_text())
        nodes = {p["node_id"] for p in placement}
        assert len(nodes) == 2, placement  # SPREAD put the actors on both nodes
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2]
    finally:
        if worker is not None:
            stop_node(worker, worker_tmp)
        stop_node(head, head_tmp)
        log.close()
