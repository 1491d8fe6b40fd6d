"""Two hosts with their own addresses, hostnames and /dev/shm (tests/hosts.py: network namespaces on a
private bridge), a Ray head on host a and a worker node on host b started as a user starts them, and
`raygrpo submit` from host a, as on two machines:

- a run with 2 learner ranks and 2 engines under SPREAD: actors on both hosts, the weights synced
  across the hosts and verified at every step, each actor's host, address and interface at start;
- a run whose trainer.run_dir host b sees as another directory (its own mount there) fails with the
  shared-storage error naming host b and the path, before any model loads;
- a partition: host b, holding one of two engines, is unreachable for 30 s (its link down, then up)
  during a training run; the run never hangs: it goes on (or restarts the learner ranks from their
  checkpoint), each step logged once, every wait it meets bounded and said on the console;
- a peer that cannot reach the address it was given fails within its bound, naming both hosts.

Skipped with the reason where root or `ip netns` is missing. Every process is stopped by pid
(`ip netns pids`) and the namespaces deleted, even on failure.
"""
from __future__ import annotations

import json
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import hosts
import pytest

BIN = Path(sys.executable).parent
WHY_NOT = hosts.unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")

RUN = ["examples/cpu_demo.yaml", "trainer.prompts_per_step=4", "trainer.group_size=4", "data.num_eval=4",
       "data.task_digits=1", "rollout.num_workers=2", "rollout.max_model_len=48", "rollout.max_new_tokens=6",
       "rollout.gpu_memory_utilization=0.03", "learner.num_ranks=2", "learner.zero_stage=3",
       "metrics.tensorboard=false", "checkpoint.every=0", "ray.strategy=SPREAD"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Host a (Ray head, 3 CPUs) and host b (a worker node, 1 CPU: room for one engine or two 0.5-CPU actors,
    never for a 2-CPU learner rank). Host b has a directory of its own mounted over `elsewhere`: a run dir
    under it is another directory there than on host a."""
    base = tmp_path_factory.mktemp("two_hosts")
    elsewhere, own = base / "elsewhere", base / "host_b_own"
    elsewhere.mkdir()
    own.mkdir()
    made = hosts.Hosts(("a", "b"), mounts={"b": {str(elsewhere): str(own)}})
    a, b = made.create()
    log = open(base / "ray_nodes.log", "w")
    try:
        hosts.ray_head(a, tempfile.mkdtemp(prefix="rg-host-a-"), log)
        hosts.wait_for_nodes(a, a, 1)
        hosts.ray_worker(b, a, tempfile.mkdtemp(prefix="rg-host-b-"), log, num_cpus=1)
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


PARTITION_S = 30
SILENCE_BOUND_S = 60  # the console says what a wait waits on every 25 s (WAITING_LINE_EVERY_S): never silent longer


def train_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in (json.loads(x) for x in lines if x.strip().endswith("}")) if r.get("kind") == "train"]


# The last test on the module's cluster: a partition Ray notices marks host b's node dead, and Ray does not
# take a dead node back (its raylet exits when the link returns).
@pytest.mark.timeout(900)
def test_a_partition_of_the_host_of_an_engine_for_30s_never_hangs_the_run(cluster, tiny_model_dir, tmp_path):
    a, b, _ = cluster
    run_dir, console, steps = tmp_path / "run", tmp_path / "train.log", 12
    # `raygrpo train` on host a joining the cluster: the learner rank (2 CPUs) and engine 0 fill host a, so
    # engine 1 is on host b (1 CPU), alone. rollout.min_workers=1: the run may go on with one engine.
    cmd = [str(BIN / "raygrpo"), "train", "examples/cpu_demo.yaml", f"ray.address={a.address}:{hosts.GCS_PORT}",
           f"model.path={tiny_model_dir}", f"trainer.run_dir={run_dir}", f"trainer.steps={steps}",
           "trainer.prompts_per_step=4", "trainer.group_size=2", "trainer.dynamic_sampling=false",
           "trainer.eval_every=0", "data.num_eval=0", "data.task_digits=1", "rollout.num_workers=2",
           "rollout.min_workers=1", "rollout.num_cpus=1", "learner.num_cpus=2", "rollout.max_model_len=48",
           "rollout.max_new_tokens=4", "rollout.gpu_memory_utilization=0.03", "rollout.cpu_kv_cache_mb=32",
           "algo.beta=0", "metrics.tensorboard=false", "checkpoint.every=5", "trainer.halt_after=0"]
    with open(console, "w") as out:
        proc = a.popen(cmd, env=hosts.USER_ENV, log=out)
    try:
        deadline = time.time() + 600
        while len(train_rows(run_dir)) < 2:
            assert proc.poll() is None and time.time() < deadline, console.read_text()[-5000:]
            time.sleep(0.2)
        placement = json.loads((run_dir / "placement.json").read_text())
        on_b = [p["role"] for p in placement if p["network"]["hostname"] == b.hostname]
        assert len(on_b) == 1 and on_b[0].startswith("rollout-"), placement
        engine = on_b[0].replace("rollout-", "rollout worker ")

        partitioned_at = len(console.read_text())
        b.link_down()
        t0 = last_change = time.monotonic()
        size, silent = partitioned_at, 0.0
        healed = False
        while proc.poll() is None or not healed:  # the console's longest silence, from the partition to the end
            if not healed and time.monotonic() - t0 >= PARTITION_S:
                b.link_up()
                healed, running_at_heal = True, proc.poll() is None
            grown = len(console.read_text())
            if grown != size:
                size, last_change = grown, time.monotonic()
            silent = max(silent, time.monotonic() - last_change)
            assert time.monotonic() - t0 < 600, f"no end 600 s after the partition:\n{console.read_text()[-5000:]}"
            time.sleep(0.2)
        code = proc.wait()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
    text = console.read_text()
    print(text[-8000:])
    after = text[partitioned_at:]
    assert code == 0, text[-5000:]
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # each step once
    assert all(r["sync_verified"] for r in rows)
    assert silent < SILENCE_BOUND_S, f"the console said nothing for {silent:.0f}s after the partition"
    waits = re.findall(r"waiting on (.+?) \((.+?)\): \d+s so far, at most trainer.actor_timeout_s=\d+s", after)
    lost = f"lost host {b.address} ({b.hostname}, Ray node "
    # Either Ray noticed the partition (marked host b dead: the engine left the fleet, the run went on, or the
    # learner ranks restarted from their checkpoint when it caught a weight transfer), or it did not and the
    # calls to host b waited for the link, each wait said.
    assert waits or lost in after, after[-5000:]
    if lost in after:
        assert f"it held {engine}" in after and f"{engine} left the fleet with its host" in after
        assert ("restarting the learner ranks" in after) == ("resumed from" in after)
        assert "restarting every actor" not in after
    else:
        assert all(r["rollout/live_engines"] == 2 for r in rows)
    # Ray's raw lines stay in the run's logs: the node's death, its raylet exiting when the link is back, a
    # call given up on
    for raw in ("has been marked dead because", "mistakenly been marked as dead", "Raylet is terminated",
                "Unhandled error"):
        assert raw not in text, raw
    came_back = f"host {b.address} ({b.hostname}, Ray node "
    print(f"partition: the run was {'running' if running_at_heal else 'finished'} when the link came back; "
          f"the console's longest silence after it {silent:.0f}s; waits said: {sorted(set(waits))}; "
          f"host b {'marked dead' if lost in after else 'never marked dead'}; "
          f"its raylet's exit said: {came_back in after}")


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
