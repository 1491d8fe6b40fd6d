"""A lost host costs only what it held (issue 39): a real Ray cluster of separate raylets on this machine,
started as a user starts them, and a host "lost" by SIGKILLing every process of its raylet by pid.

- engines only on the lost host: the run goes on with the engine that survives (no restart, no step
  redone, the step's missing groups regenerated on the survivor), and the lost engine comes back,
  with verified weights, when a node with room joins;

Each node runs its own raylet (its own temp dir and session): its processes are found by session id
and process tree, never by name. Where two network namespaces are available the multi-host fixture
(tests/e2e: netns) gives each host its own address; here every node is on 127.0.0.1.
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

import psutil
import pytest

from actors.runtime.sockets import free_port
from cluster.launch.ray_cluster import NODE_START_ENV

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# A user's environment: no RAY_* variable, the venv not on PATH (README, "On a cluster").
ENV = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
ENV["PATH"] = os.pathsep.join(p for p in ENV.get("PATH", "/usr/bin:/bin").split(os.pathsep)
                              if p and Path(p).resolve() != BIN.resolve())
NODE_ENV = {**ENV, **NODE_START_ENV, "RAY_AUTH_MODE": "token"}  # a node joining a token-authenticated head


class Node:
    """One `ray start --block` raylet with its own temp dir; `lose()` SIGKILLs every process of it."""

    def __init__(self, args: list[str], log):
        self.temp_dir = tempfile.mkdtemp(prefix="rg-lost-")
        self.proc = subprocess.Popen([str(BIN / "ray"), "start", "--block", f"--temp-dir={self.temp_dir}",
                                      "--disable-usage-stats", *args], env=NODE_ENV, cwd=self.temp_dir, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def pids(self) -> list[int]:
        """Its processes: the tree under `ray start`, and whatever shares its session (started with
        start_new_session, so the session id is its pid)."""
        out = set()
        try:
            root = psutil.Process(self.proc.pid)
            out |= {root.pid, *(c.pid for c in root.children(recursive=True))}
        except psutil.NoSuchProcess:
            pass
        for p in psutil.process_iter():
            try:
                if os.getsid(p.pid) == self.proc.pid:
                    out.add(p.pid)
            except (ProcessLookupError, PermissionError):
                continue
        return sorted(out)

    def lose(self) -> list[int]:
        """Every process of the host at once, SIGKILL (the host is gone, nothing says goodbye)."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids


def alive_nodes(gcs: str) -> int:
    probe = ("import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False, logging_level='ERROR'); "
             "print(sum(n['Alive'] for n in ray.nodes()))")
    out = subprocess.run([sys.executable, "-c", probe, gcs], env={**ENV, "RAY_AUTH_MODE": "token"}, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else 0


def wait_nodes(gcs: str, n: int, timeout_s: float = 240) -> None:
    deadline = time.time() + timeout_s
    while alive_nodes(gcs) < n:
        assert time.time() < deadline, f"{n} Ray nodes not up at {gcs} within {timeout_s:.0f}s"
        time.sleep(3)


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in (json.loads(x) for x in path.read_text().splitlines() if x.strip().endswith("}"))
            if r.get("kind") == "train"]


@pytest.fixture
def cluster(tmp_path):
    """A head with room for the learner rank (2 CPUs) and one engine (1 CPU), and a host b with room
    for one engine: PACK puts one engine on each. Every node is stopped at the end, by pid."""
    log = open(tmp_path / "ray_nodes.log", "w")
    gcs_port = free_port()
    nodes = [Node(["--head", "--node-ip-address=127.0.0.1", f"--port={gcs_port}", "--include-dashboard=false",
                   "--num-cpus=3", f"--ray-client-server-port={free_port()}"], log)]

    def add_node() -> Node:
        nodes.append(Node([f"--address=127.0.0.1:{gcs_port}", "--node-ip-address=127.0.0.1", "--num-cpus=1"], log))
        return nodes[-1]

    try:
        gcs = f"127.0.0.1:{gcs_port}"
        wait_nodes(gcs, 1)
        yield gcs, add_node
    finally:
        for node in reversed(nodes):
            node.lose()
            node.proc.wait(timeout=30)
        log.close()


@pytest.mark.timeout(1500)
def test_engines_lost_with_their_host_cost_no_step_and_come_back_when_a_node_joins(cluster, tiny_model_dir, tmp_path):
    gcs, add_node = cluster
    host_b = add_node()
    wait_nodes(gcs, 2)
    run_dir, steps = tmp_path / "run", 40
    console = tmp_path / "train.log"
    out = open(console, "w")
    proc = subprocess.Popen(
        [str(BIN / "raygrpo"), "train", "examples/cpu_demo.yaml", f"ray.address={gcs}", f"model.path={tiny_model_dir}",
         f"trainer.run_dir={run_dir}", f"trainer.steps={steps}", "trainer.prompts_per_step=4", "trainer.group_size=2",
         "trainer.dynamic_sampling=false", "trainer.eval_every=0", "data.num_eval=0", "data.task_digits=1",
         "rollout.num_workers=2", "rollout.min_workers=1", "rollout.num_cpus=1", "learner.num_cpus=2",
         "rollout.max_model_len=48", "rollout.max_new_tokens=4", "rollout.gpu_memory_utilization=0.03",
         "algo.beta=0", "metrics.tensorboard=false", "checkpoint.every=0", "ray.strategy=PACK"],
        cwd=ROOT, env=ENV, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 900
        while len(rows(run_dir)) < 2:
            assert proc.poll() is None, console.read_text()[-5000:]
            assert time.time() < deadline, "no 2 steps in 900 s"
            time.sleep(1)
        placement = json.loads((run_dir / "placement.json").read_text())
        on_b = [p["role"] for p in placement if p["pid"] in host_b.pids()]
        assert len(on_b) == 1 and on_b[0].startswith("rollout-"), placement  # one engine on host b, nothing else
        lost_at = len(rows(run_dir))
        host_b.lose()
        add_node()  # a node with room for one engine joins: the lost engine comes back there
        assert proc.wait(timeout=1200) == 0, console.read_text()[-5000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        out.close()
    text, train = console.read_text(), rows(run_dir)
    print(text[-6000:])
    assert [r["step"] for r in train] == list(range(1, steps + 1))  # each step once: none redone
    lost_engine = on_b[0].replace("rollout-", "rollout worker ")
    assert "lost host 127.0.0.1 (" in text and f"it held {lost_engine}" in text, text[-5000:]
    assert "has been marked dead because" not in text  # Ray's raw raylet line stays in the run's logs
    assert "restarting every actor" not in text and "resumed from" not in text
    live = [r["rollout/live_engines"] for r in train]
    assert live[:lost_at] == [2] * lost_at and 1 in live[lost_at:] and live[-1] == 2, live
    assert f"{lost_engine} rejoined on 127.0.0.1" in text and "fingerprint verified" in text
    assert all(r["sync_verified"] for r in train)
    assert all(r["trained_groups"] == 4 for r in train)  # the lost engine's groups were regenerated
