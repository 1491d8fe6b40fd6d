"""A Ray cluster in containers, as docker/compose.yaml starts it (a head and two workers), running
a job that `raygrpo submit` sends from this machine: 3 training steps whose actors spread over the
containers, checked in the metrics the job writes to the shared directory.

Where the daemon offers no container networks (dockerd --bridge=none, as on the development
machines) the nodes share the host's network (docker/compose.host.yaml), on ports picked free
here. The containers and the project's volumes are removed at the end, the image is kept.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import time
from pathlib import Path

import pytest
from docker_helpers import IMAGE, ROOT, free_port, run

pytestmark = pytest.mark.docker
BIN = Path(sys.executable).parent

# The job's settings: those of tests/e2e/test_multinode.py, 3 steps, actors SPREAD over the nodes.
JOB = ["trainer.steps=3", "trainer.prompts_per_step=4", "trainer.group_size=4", "data.num_eval=4", "data.task_digits=1",
       "rollout.num_workers=2", "rollout.max_model_len=48", "rollout.max_new_tokens=6",
       "rollout.gpu_memory_utilization=0.03", "learner.num_ranks=2", "learner.zero_stage=3",
       "metrics.tensorboard=false", "checkpoint.every=0", "ray.strategy=SPREAD"]


def container_networks_work() -> bool:
    """False where dockerd runs with --bridge=none (no default bridge network to attach to)."""
    return run(["docker", "network", "inspect", "bridge"]).returncode == 0


def alive_nodes(compose_cmd: list[str], env: dict) -> int:
    probe = "import ray; ray.init(address='auto', logging_level='ERROR'); print(sum(n['Alive'] for n in ray.nodes()))"
    out = run([*compose_cmd, "exec", "-T", "head", "python", "-c", probe], env=env, timeout=120)
    return int(out.stdout.split()[-1]) if out.returncode == 0 and out.stdout.split() else 0


@pytest.mark.timeout(2400)
def test_compose_cluster_runs_a_job_submitted_from_the_host(cpu_image, compose, tiny_model_dir, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # the containers' user (uid 1000) writes the run dir here
    shutil.copytree(tiny_model_dir, shared / "model")
    for path in [shared / "model", *(shared / "model").iterdir()]:  # readable by the containers' user
        path.chmod(0o755 if path.is_dir() else 0o644)  # (the model cache is written 0700/0600)
    dashboard_port = free_port()
    env = {**os.environ, "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAYGRPO_SHARED": str(shared), "RAYGRPO_IMAGE": IMAGE,
           "RAY_DASHBOARD_PORT": str(dashboard_port)}
    if container_networks_work():
        file = "compose.yaml"
    else:
        file = "compose.host.yaml"
        env.update(RAY_GCS_PORT=str(free_port()), RAY_CLIENT_PORT=str(free_port()))
    project = f"raygrpo-test-{os.getpid()}"
    compose_cmd = [*compose, "-f", str(ROOT / "docker" / file), "-p", project]
    address = f"http://127.0.0.1:{dashboard_port}"
    try:
        up = run([*compose_cmd, "up", "-d", "--scale", "worker=2"], env=env, timeout=300)
        assert up.returncode == 0, up.stderr[-3000:]
        deadline = time.time() + 240
        while (n := alive_nodes(compose_cmd, env)) < 3 and time.time() < deadline:
            time.sleep(3)
        assert n == 3, f"{n} of 3 Ray nodes came up"
        # As a user of compose.yaml does: RAY_AUTH_TOKEN exported, `raygrpo submit` from the checkout.
        sub = run([str(BIN / "raygrpo"), "submit", "examples/cpu_demo.yaml", "--address", address,
                   "model.path=/shared/model", "trainer.run_dir=/shared/run", *JOB],
                  cwd=ROOT, env={**os.environ, "RAY_AUTH_TOKEN": env["RAY_AUTH_TOKEN"]}, timeout=1800)
        print(sub.stdout[-6000:], sub.stderr[-3000:])
        assert sub.returncode == 0, sub.stderr[-3000:]
        assert "SUCCEEDED" in sub.stdout
        assert "driver runs on /opt/raygrpo/.venv/bin/python" in sub.stdout  # the image's Python, in the head
        rows = [json.loads(x) for x in (shared / "run" / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in rows if r["kind"] == "train"]
        assert [r["step"] for r in train] == [1, 2, 3]
        for r in train:
            assert r["weight_version"] == r["step"] and r["sync_bytes"] > 0, r  # each step's weights went to the engines
        nodes = {p["node_id"] for p in json.loads((shared / "run" / "placement.json").read_text())}
        assert len(nodes) >= 2, nodes  # SPREAD put the actors in more than one container
    finally:
        logs = run([*compose_cmd, "logs", "--tail", "40"], env=env)
        print(logs.stdout[-6000:])
        down = run([*compose_cmd, "down", "--volumes", "--timeout", "30"], env=env, timeout=300)
        # what the containers wrote belongs to their user: remove it as that user
        run(["docker", "run", "--rm", "--network", "none", "-v", f"{shared}:/shared", IMAGE, "rm", "-rf", "/shared/run"])
    assert down.returncode == 0, down.stderr[-3000:]
    left = run(["docker", "ps", "-a", "-q", "--filter", f"label=com.docker.compose.project={project}"])
    assert left.stdout.strip() == "", f"containers left behind: {left.stdout}"
