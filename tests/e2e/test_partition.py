"""A partition heals (issue 39, item 5): two hosts with their own addresses (tests/hosts.py), a Ray head on
host a and a worker node on host b holding one of the run's two engines; host b's link is pulled for 30 s
during `raygrpo train` (its switch port down, then up). The run never hangs: it ends by itself, each step
logged once and every sync verified; every wait it meets is said on the console (never silent for 60 s), or
the loss of host b is, in raygrpo's words; none of Ray's raw lines about it reach the console.

Skipped with the reason where root or `ip netns` is missing. Every process is stopped by pid (`ip netns
pids`) and the namespaces deleted, even on failure.

The run is as long as its behaviour needs (issue 58): TCP on both hosts resends at least every second
(hosts.Host.quick_tcp_resend, where the kernel has net.ipv4.tcp_rto_max_ms), so the calls under way go on
within a second of the link coming back instead of at their next backed-off resend: the step the partition
caught took 58 s without it, 33 s with it (2026-11-29); the partition itself stays 30 s, past the 25 s after which
a wait is said.
"""
from __future__ import annotations

import json
import re
import signal
import time

import host_runs
import hosts
import pytest
from host_runs import train_rows

WHY_NOT = hosts.unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")

PARTITION_S = 30
SILENCE_BOUND_S = 60  # the console says what a wait waits on every 25 s (WAITING_LINE_EVERY_S): never silent longer


@pytest.fixture
def cluster(tmp_path):
    """Host a (Ray head, 3 CPUs: the learner rank and one engine) and host b (a worker node, 1 CPU: one engine,
    never a 2-CPU learner rank), so what host b holds does not depend on Ray's choice. Its own cluster: a
    partition that Ray notices leaves host b's node dead (its raylet exits when the link is back)."""
    made = hosts.Hosts(("a", "b"))
    a, b = made.create()
    log = open(tmp_path / "ray_nodes.log", "w")
    for h in (a, b):  # before any process starts: a socket reads it when made
        h.quick_tcp_resend()
    try:
        hosts.ray_head(a, made.temp_dir("rg-host-a-"), log, num_cpus=3)
        hosts.wait_for_nodes(a, a, 1)
        hosts.ray_worker(b, a, made.temp_dir("rg-host-b-"), log, num_cpus=1)
        hosts.wait_for_nodes(a, a, 2)
        yield a, b
    finally:
        made.destroy()  # every process of both hosts, by pid; then the namespaces
        log.close()


@pytest.mark.timeout(900)
def test_a_partition_of_the_host_of_an_engine_for_30s_never_hangs_the_run(cluster, tiny_model_dir, tmp_path):
    a, b = cluster
    run_dir, console, steps = tmp_path / "run", tmp_path / "train.log", 12
    # `raygrpo train` on host a joining the cluster: the learner rank (2 CPUs) and engine 0 fill host a, so
    # engine 1 is on host b (1 CPU), alone. rollout.min_workers=1: the run may go on with one engine.
    with open(console, "w") as out:
        proc = host_runs.train(a, tiny_model_dir, run_dir, steps, ["rollout.num_workers=2", "rollout.min_workers=1",
                                                                   "checkpoint.every=5"], out)
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
