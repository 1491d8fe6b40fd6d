"""Issue 59, item 13, on a started cluster: the embedded default cluster's every listening socket (the GCS, the
raylet, the dashboard and runtime-env agents, the driver's and an actor's gRPC servers) is on the loopback, and
Ray's token file is 0600. What it tests is the start itself, so it starts its own cluster (in a subprocess, with
its own HOME: the session's cluster and the user's token file are not touched)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, os, stat, psutil, ray
from cluster.launch.ray_cluster import start_ray
start_ray("", 2)

@ray.remote(num_cpus=0)
class Probe:
    def pid(self):
        return os.getpid()

# The handle kept: an actor whose last handle is dropped is ended by Ray, and a probe that read the sockets
# after that found no actor (it failed twice in full suites and once in CI, under load)
probe = Probe.remote()
actor_pid = ray.get(probe.pid.remote())
actor = psutil.Process(actor_pid)
# Ray starts and ends helper processes meanwhile: one gone between being listed and being read is skipped
procs = {psutil.Process(), actor}
for parent in (psutil.Process(), actor):
    for child in parent.children(recursive=True):
        procs.add(child)
listening = set()
for p in procs:
    try:
        listening |= {(c.laddr.ip, p.name(), p.pid) for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN}
    except psutil.NoSuchProcess:
        pass
token = os.path.expanduser("~/.ray/auth_token")
print(json.dumps({"listening": sorted(listening), "actor_pid": actor_pid, "node_ip": ray.util.get_node_ip_address(),
                  "token_mode": oct(stat.S_IMODE(os.stat(token).st_mode)) if os.path.exists(token) else None}))
ray.shutdown()
"""


def test_the_embedded_cluster_listens_on_the_loopback_only_and_its_token_is_private(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    names = {name for _, name, _ in seen["listening"]}
    # The actor by its pid: its process name is "ray::Probe" only once Ray retitled the worker it reused
    assert {"gcs_server", "raylet"} <= names and seen["actor_pid"] in {pid for _, _, pid in seen["listening"]}, seen
    assert all(ip in ("127.0.0.1", "::ffff:127.0.0.1", "::1") for ip, _, _ in seen["listening"]), seen["listening"]
    assert seen["node_ip"] == "127.0.0.1"
    assert seen["token_mode"] in (None, "0o600"), seen
