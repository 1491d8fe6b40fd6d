"""A partition heals (issue 39, item 5): two hosts with their own addresses (tests/hosts.py), a Ray head on
host a and a worker node on host b holding one of the run's two engines; host b's link is pulled for 30 s
during `raygrpo train` (its switch port down, then up). The run never hangs: it ends by itself, each step
logged once and every sync verified, both engines generating at every step; every wait it meets is said on
the console (never silent for 60 s); none of Ray's raw lines about it reach the console.

The partition is shorter than Ray's node-death detection, so its path is known: the head's GCS marks a node
dead after 30 failed health checks (RAY_health_check_failure_threshold, 5 by default), each at least 3 s after
the last: at least 90 s, three times the partition, whatever the load, so the calls to host b wait for the link
and go on once it is back. At Ray's default a check failed here every 13 s (its 10 s deadline, then 3 s; the
GCS log, 2026-11-29), ~60 s to a death, but one that fails at once would take 15 s. Where Ray does mark a host
dead, the engine leaving the fleet with it and the learner restart are test_lost_host's, and the raylet that
exits when the link comes back (its lines kept off the console, said once in raygrpo's words)
tests/unit/test_node_death_lines.py's.

Skipped with the reason where root or `ip netns` is missing. Every process is stopped by pid (`ip netns
pids`) and the namespaces deleted, even on failure.

The run is as long as its behaviour needs (issue 58): 8 steps, the partition pulled once step 2 is logged, so
that it catches one of the next (both engines generate every step and every sync goes to both: no step can end
without host b) and the steps after it run whole after the heal, their syncs verified on both engines. (With 4
steps of 0.3 s each, the partition caught step 4, the last, in one full run: too thin a margin for a test
process slower than the run's actors.) TCP on both hosts
resends at least every second (hosts.Host.quick_tcp_resend, where the kernel has net.ipv4.tcp_rto_max_ms), so
the calls under way go on within a second of the link coming back instead of at their next backed-off
resend: the step the partition caught took 58 s without it, 33 s with it (2026-11-29); the partition itself
stays 30 s, past the 25 s after which a wait is said.

A generate the partition catches was lost, before the fix, until Ray's gRPC client keepalive
(grpc_client_keepalive_time_ms, 300 s): that step took 302-307 s in 3 of 4 runs that caught one (2026-11-29).
Now the wait sends the engine a probe at each waiting line (actors/runtime/waits.py wait_for): the lost call
fails with it, the engine answers again as the same process, is re-synced and gets its prompts again, and the
step takes ~34 s (2026-11-29, later). Every wait said after the partition is therefore under LOST_CALL_BOUND_S. The
engines write up to 40 tokens, so that generation, not the weight sync, is most of a step, and the partition
most often catches a generate.
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
# A caught call lost until Ray's 300 s gRPC keepalive is said waiting at 275 s; one the probe ends, by ~50 s
LOST_CALL_BOUND_S = 200
# Ray marks a node dead after this many failed health checks, health_check_period_ms (3 s) apart: >= 90 s, so never
# within the partition (module docstring)
SLOW_NODE_DEATH_ENV = {"RAY_health_check_failure_threshold": "30"}


@pytest.fixture
def cluster(tmp_path):
    """Host a (Ray head, 3 CPUs: the learner rank and one engine) and host b (a worker node, 1 CPU: one engine,
    never a 2-CPU learner rank), so what host b holds does not depend on Ray's choice. Its own cluster, its
    head slow to mark a node dead (SLOW_NODE_DEATH_ENV)."""
    made = hosts.Hosts(("a", "b"))
    a, b = made.create()
    log = open(tmp_path / "ray_nodes.log", "w")
    for h in (a, b):  # before any process starts: a socket reads it when made
        h.quick_tcp_resend()
    try:
        hosts.ray_head(a, made.temp_dir("rg-host-a-"), log, num_cpus=3, ray_env=SLOW_NODE_DEATH_ENV)
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
    run_dir, console, steps = tmp_path / "run", tmp_path / "train.log", 8
    # `raygrpo train` on host a joining the cluster: the learner rank (2 CPUs) and engine 0 fill host a, so
    # engine 1 is on host b (1 CPU), alone. rollout.min_workers=1: were host b lost, the run could go on without it.
    with open(console, "w") as out:
        proc = host_runs.train(a, tiny_model_dir, run_dir, steps,
                               ["rollout.num_workers=2", "rollout.min_workers=1", "rollout.max_new_tokens=40",
                                "rollout.max_model_len=64", "trainer.prompts_per_step=8"], out)
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
    said = re.findall(r"waiting on (.+?) \((.+?)\): (\d+)s so far, at most trainer.actor_timeout_s=\d+s", after)
    waits = [(who, what) for who, what, _ in said]
    longest = max((int(seconds) for _, _, seconds in said), default=0)
    assert longest < LOST_CALL_BOUND_S, f"a call caught by the partition waited {longest}s: lost until Ray's keepalive"
    # Ray did not notice the partition: the calls to host b waited for the link, each wait said, and went on. A
    # call caught is a generate on host b's engine or the learner's weight transfer, which sends to it too.
    assert any(who == engine or what.startswith("sending weights") for who, what in waits), after[-5000:]
    assert running_at_heal  # the partition held the run (the step it caught could not end without host b)
    assert all(r["rollout/live_engines"] == 2 for r in rows)  # host b's engine generated at every step
    for said in (f"lost host {b.address}", "left the fleet", "restarting the learner ranks", "restarting every actor"):
        assert said not in after, said
    # Ray's raw lines stay in the run's logs: a node's death, a raylet exiting, a call given up on
    for raw in ("has been marked dead because", "mistakenly been marked as dead", "Raylet is terminated",
                "Unhandled error"):
        assert raw not in text, raw
    print(f"partition: the console's longest silence after it {silent:.0f}s; waits said: {sorted(set(waits))}")
