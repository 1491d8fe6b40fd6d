"""Two hosts with their own addresses, hostnames and /dev/shm (tests/hosts.py: network namespaces on a
private bridge), a Ray head on host a and a worker node on host b started as a user starts them, and
`raygrpo submit` from host a, as on two machines:

- a run with 2 learner ranks and 2 engines under SPREAD: actors on both hosts, the weights synced
  across the hosts and verified at every step, each actor's host, address and interface at start;
- a run whose trainer.run_dir host b sees as another directory (its own mount there) fails with the
  shared-storage error naming host b and the path, before any model loads;
- a peer that cannot reach the address it was given fails within its bound, naming both hosts.
(A partition, host b's link pulled for 30 s during a run: tests/e2e/test_partition.py, on its own cluster.)

Skipped with the reason where root or `ip netns` is missing. Every process is stopped by pid
(`ip netns pids`) and the namespaces deleted, even on failure.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import hosts
import pytest

BIN = Path(sys.executable).parent
WHY_NOT = hosts.unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")

# Two engines, not one: the weights cross hosts only where an engine is on another host than learner rank 0 (the
# sender), and SPREAD does not keep one engine off rank 0's node: with one it placed it there in 19 of 24 tries (two
# 3-CPU nodes in ray.cluster_utils, this run's bundles; with two, an engine was elsewhere in 18 of 24; session 23).
RUN = ["examples/cpu_demo.yaml", "trainer.prompts_per_step=4", "trainer.group_size=4", "data.num_eval=4",
       "data.task_digits=1", "rollout.num_workers=2", "rollout.max_model_len=48", "rollout.max_new_tokens=6",
       "rollout.gpu_memory_utilization=0.03", "learner.num_ranks=2", "learner.zero_stage=3",
       "metrics.tensorboard=false", "checkpoint.every=0", "ray.strategy=SPREAD"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Host a (Ray head) and host b (a worker node). Host b has a directory of its own mounted over
    `elsewhere`: a run dir under it is another directory there than on host a."""
    base = tmp_path_factory.mktemp("two_hosts")
    elsewhere, own = base / "elsewhere", base / "host_b_own"
    elsewhere.mkdir()
    own.mkdir()
    made = hosts.Hosts(("a", "b"), mounts={"b": {str(elsewhere): str(own)}})
    a, b = made.create()
    log = open(base / "ray_nodes.log", "w")
    try:
        hosts.ray_head(a, made.temp_dir("rg-host-a-"), log)
        hosts.wait_for_nodes(a, a, 1)
        hosts.ray_worker(b, a, made.temp_dir("rg-host-b-"), log)
        hosts.wait_for_nodes(a, a, 2)
        yield a, b, elsewhere
    finally:
        made.destroy()  # every process of both hosts, by pid; then the namespaces
        log.close()


def submit(a, overrides: list[str]):
    out = a.run([str(BIN / "raygrpo"), "submit", *RUN, "--address", hosts.dashboard(a), *overrides],
                env=hosts.USER_ENV, timeout=800)
    print(out.stdout[-6000:], out.stderr[-3000:])
    return out


@pytest.mark.timeout(900)
def test_submit_across_two_hosts_syncs_weights_verified_and_shows_where_each_actor_is(cluster, tiny_model_dir,
                                                                                     tmp_path):
    a, b, _ = cluster
    run_dir = tmp_path / "run"
    out = submit(a, [f"model.path={tiny_model_dir}", f"trainer.run_dir={run_dir}", "trainer.steps=2",
                     "ray.network_interface=eth0"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "submitted job" in out.stdout and "SUCCEEDED" in out.stdout
    assert f"driver runs on {BIN / 'python'}" in out.stdout  # the cluster's Python, not the first on PATH

    placement = {p["role"]: p for p in json.loads((run_dir / "placement.json").read_text())}
    address = {h.hostname: h.address for h in (a, b)}
    for role, p in placement.items():  # each actor: its host, the address it advertises, the pinned interface
        net = p["network"]
        assert net["hostname"] in address and net["address"] == address[net["hostname"]], (role, net)
        assert net["interface"] == "eth0" and net["interface_from"] == "pinned by GLOO_SOCKET_IFNAME", (role, net)
        assert net["nccl_interface"] == "eth0"
        line = (f"network: {net['hostname']} advertises {net['address']}, gloo/NCCL interface eth0 "
                f"(pinned by GLOO_SOCKET_IFNAME): ")
        assert line in out.stdout and role in out.stdout.split(line)[1].splitlines()[0], (role, line)
    assert {p["network"]["hostname"] for p in placement.values()} == {"host-a", "host-b"}  # SPREAD: both hosts
    sender = placement["learner-0"]["network"]["hostname"]
    assert any(p["network"]["hostname"] != sender for r, p in placement.items() if r.startswith("rollout")), \
        placement  # an engine on the other host: the weights crossed the link

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert all(r["sync_verified"] is True and r["sync_bytes"] > 0 for r in train), train


@pytest.mark.timeout(600)
def test_a_host_that_sees_another_run_dir_fails_before_any_model_loads(cluster, tiny_model_dir):
    a, b, elsewhere = cluster
    run_dir = elsewhere / "run"  # host a (the driver) sees it; host b sees its own empty directory there
    out = submit(a, [f"model.path={tiny_model_dir}", f"trainer.run_dir={run_dir}", "trainer.steps=1"])
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert (f"host host-b ({b.address}) does not see this run dir, trainer.run_dir={run_dir}: the driver wrote "
            ".raygrpo-shared-storage-check there, host-b reads no such file there") in text
    assert "host host-a" not in text  # the driver's host sees it
    assert "must read model.path and see the same trainer.run_dir" in text
    assert "rollout worker 0 ready" not in text and "starting DeepSpeed" not in text  # no model was loaded
    assert not (run_dir / ".raygrpo-shared-storage-check").exists()  # the check leaves nothing behind


@pytest.mark.timeout(120)
def test_a_peer_that_cannot_reach_the_advertised_address_fails_within_its_bound_naming_both_hosts():
    with hosts.two_hosts() as (a, b):
        b.link_down()  # host b is off the network: host a's connects get no answer
        probe = ("from actors.runtime.sockets import reach; "
                 f"reach('{b.address}', 29500, 3, 'learner rank 1', \"learner rank 0's rendezvous on host-b\")")
        out = a.run([sys.executable, "-c", probe], timeout=100)
    assert out.returncode == 1, out.stderr
    assert "PeerUnreachable: learner rank 1 on host-a (" in out.stderr
    assert (f"could not reach learner rank 0's rendezvous on host-b at the address it advertises, {b.address}:29500, "
            "within 3s") in out.stderr
