"""docker/slurm.sbatch's wait for its Ray nodes, run by bash with `ray` faked (no SLURM, no Ray): a head
whose `ray start` exits fails the job at once, even while a `ray status` still waits for its GCS (Ray's
connect timeouts hold it ~40 s: the head-that-cannot-start case took 47 s, issue 58); nodes that are up
end the wait. tests/e2e/test_slurm.py runs the whole script on a two-node SLURM cluster."""
from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def wait_functions() -> str:
    """The script's head_exited, its temp file and wait_for_nodes, as the script defines them."""
    text = (ROOT / "docker" / "slurm.sbatch").read_text()
    m = re.search(r"^head_exited\(\) \{.*?^wait_for_nodes\(\) \{.*?^\}$", text, flags=re.S | re.M)
    assert m, "docker/slurm.sbatch no longer defines head_exited and wait_for_nodes"
    return m.group(0)


def run_wait(fake_ray: str, head: str, want: int) -> tuple[subprocess.CompletedProcess, float]:
    """wait_for_nodes `want` with `ray` as the bash function `fake_ray` and the head as the command `head`."""
    script = "\n".join([
        "set -euo pipefail", f"ray() {{ {fake_ray}; }}", "head=node1 head_ip=127.0.0.1 port=6379",
        "RAYGRPO_NODE_WAIT_S=60", wait_functions(), f"{head} >/dev/null 2>&1 &", "head_pid=$!",
        f"wait_for_nodes {want}", 'kill "$head_pid"'])  # a head still up is ended here, not left behind
    t0 = time.monotonic()
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    return out, time.monotonic() - t0


def test_a_head_that_exits_while_ray_status_waits_fails_the_job_within_seconds():
    # `exec`: the background `ray status` is the sleep itself, so the script's kill ends it (nothing left behind)
    out, took = run_wait("exec sleep 30", "sleep 1", want=1)
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "raygrpo: the Ray head on node1 exited" in out.stderr
    assert took < 15, took  # not the ~30 s the status call would have waited


def test_the_wait_ends_when_ray_status_lists_every_node_and_says_when():
    status = "echo Active:; echo ' 1 node_aaa'; echo ' 1 node_bbb'; echo Pending:; echo ' node_ccc'"
    out, _ = run_wait(status, "sleep 30", want=2)
    assert out.returncode == 0, (out.stdout, out.stderr)
    assert re.search(r"raygrpo: 2 of 2 Ray node\(s\) up \(\d+ s into the job\)", out.stdout), out.stdout
