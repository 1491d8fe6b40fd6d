"""A lost host costs only what it held (issue 39): hosts with their own addresses, hostnames and /dev/shm
(network namespaces on one bridge, tests/hosts.py), a Ray head and worker nodes started on them as a user
starts them, and a host "lost" by SIGKILLing every process it holds, by pid (`ip netns pids`).

- an engine, the reference actor and a reward model on the lost host: the run goes on with the engine that
  survives (no restart, no step redone, the step's missing groups regenerated on the survivor); the
  reference actor and the reward model are restarted where they fit once a node with room joins (the
  reference saying so), every step scored by the reward model, and the lost engine comes back there, with
  verified weights;
- a learner rank and its engine on the lost host (ray.placement=colocate): the learner ranks restart from the
  newest checkpoint once a node with room joins (the run waits for it, saying so), the engine on the live host
  is kept, the lost one comes back, each step is logged once. (A learner rank lost alone, under PACK, takes
  the same path: it was a test of its own, 82 s of a cluster of three hosts; the rank's new node is chosen
  in tests/unit/test_placement_nodes.py, a dead rank's restart that keeps the engines is
  tests/e2e/test_train.py's test_async_run_survives_a_killed_engine_reference_and_learner_rank_and_redoes_the_lost_step_exactly);
- an elastic start in pipeline mode: room for one engine of two, rollout.min_workers=1: the run starts
  with one and feeds the other, with verified weights, when a node with room joins; that node lost, the
  run goes on with the first. (The sync schedule's rejoin is the first test's; the pool is the same.)

The console must name the lost host by its address and hostname. Skipped with the reason where root or
`ip netns` is missing; every process is stopped by pid and the namespaces deleted, even on failure. A
partition (a host's link pulled for 30 s, then put back): tests/e2e/test_partition.py.

The file's tests share one Ray head (issue 58: its start and stop paid once), each test with worker nodes on
hosts of its own, stopped at its end, the head then waited for until it is as fresh, so no test's fault
outlives it. Each run is as long as its behaviour needs: the head checks its nodes' health every second
(hosts.QUICK_NODE_DEATH_ENV), so a killed host is said 6-7 s after the kill instead of 13-17 s; the runs keep
no checkpoint but the one SIGTERM writes, except where a resume needs one; a run is stopped as soon as what is
asserted has happened.
"""
from __future__ import annotations

import dataclasses
import json
import re
import signal
import subprocess
import threading
from contextlib import contextmanager
from pathlib import Path

import host_runs
import hosts
import pytest
from console import wait_while_running

from cluster.models.tinyreward import build_reward_model
from tests.conftest import RM_SPEC, building

WHY_NOT = hosts.unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")


def train(head: hosts.Host, model_dir, run_dir: Path, steps: int, extra: list[str], out) -> subprocess.Popen:
    """tests/e2e/host_runs.py's run, its bundles packed and waiting up to 600 s for a node with room."""
    return host_runs.train(head, model_dir, run_dir, steps, ["ray.strategy=PACK", "ray.node_wait_s=600", *extra], out)


@contextmanager
def training(head: hosts.Host, model_dir, run_dir: Path, steps: int, extra: list[str], console: Path):
    """The `train` run, its output in `console`; killed at the end if it still runs."""
    with open(console, "w") as out:
        proc = train(head, model_dir, run_dir, steps, extra, out)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=60)


def wait_until(done, proc, console: Path, timeout_s: float, timeout_note: str | None = None, poll_s: float = 0.5) -> None:
    """Poll `done()` while the run lives, at most `timeout_s`; a failure shows the note and the console's tail."""
    wait_while_running(done, proc, timeout_s, lambda: f"{timeout_note or ''}\n{console.read_text()[-5000:]}", poll_s)


def wait_rows(proc, run_dir: Path, n: int, console: Path, timeout_s: float = 900, poll_s: float = 0.5) -> None:
    wait_until(lambda: len(host_runs.train_rows(run_dir)) >= n, proc, console, timeout_s, f"no {n} steps in {timeout_s:.0f} s",
               poll_s)


def finished(console: Path, run_dir: Path) -> tuple[str, list[dict]]:
    """The run's console (its tail printed for the test's log) and its training rows."""
    text = console.read_text()
    print(text[-6000:])
    return text, host_runs.train_rows(run_dir)


def on(host: hosts.Host, placement: list[dict]) -> list[str]:
    """The roles placement.json puts on `host` (by the hostname each actor reported)."""
    return sorted(p["role"] for p in placement if p["network"]["hostname"] == host.hostname)


def on_host(host: hosts.Host) -> str:
    """How the console names where an actor runs: `ADDRESS (HOSTNAME, Ray node ID)`, as a regex."""
    return rf"{re.escape(host.address)} \({re.escape(host.hostname)}, Ray node \w+\)"


def lost(host: hosts.Host) -> str:
    """How the console names a lost host: its address and hostname, in raygrpo's words."""
    return rf"lost host {on_host(host)}: "


# Hosts b-g: the worker nodes of the file's tests (two a test at most), each host used once, by one test
WORKER_HOSTS = ("b", "c", "d", "e", "f", "g")


@pytest.fixture(scope="module")
def scoring_rm() -> Path:
    """A reward model of the suite's kind (conftest.py RM_SPEC) trained for one step: the engine test needs a reward
    model that loads, scores every step and comes back with its host, not one that ranks sums well (that is
    `addition_rm`'s, 300 steps, ~25 s to train: test_reward_model.py). ~6 s to build."""
    with building("tiny-addition-rm-h64-l2-1step") as out:
        return build_reward_model(out, dataclasses.replace(RM_SPEC, steps=1, num_check=16), progress=False)


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """Host a: the Ray head, with room for a learner rank (2 CPUs) and one engine (1 CPU), where `raygrpo
    train` runs, shared by the file's tests (its start and stop, ~10 s, paid once: issue 58); and the hosts
    for their worker nodes. Every process of every host is stopped at the end, by pid, and the namespaces
    deleted."""
    made = hosts.Hosts(("a", *WORKER_HOSTS))
    a, *spare = made.create()
    log = open(tmp_path_factory.mktemp("lost-host-nodes") / "ray_nodes.log", "w")
    try:
        hosts.ray_head(a, made.temp_dir("rg-lost-a-"), log, num_cpus=3, ray_env=hosts.QUICK_NODE_DEATH_ENV)
        hosts.wait_for_nodes(a, a, 1)
        yield made, a, spare, log
    finally:
        made.destroy()
        log.close()


@pytest.fixture
def cluster(head):
    """The shared head (host a) and `add_node(cpus)`, which starts a worker node on the next unused host and
    returns it. A test's fault does not outlive it: at its end its worker nodes are stopped (by pid) and the
    head waited for until it is as fresh (its node alone alive, no actor, no placement group left), so the
    next test's run finds the room and the nodes a run of its own cluster would."""
    made, a, spare, log = head
    used: list[hosts.Host] = []

    def add_node(cpus: int = 1) -> hosts.Host:
        host = spare.pop(0)
        used.append(host)
        hosts.ray_worker(host, a, made.temp_dir(f"rg-lost-{host.name}-"), log, num_cpus=cpus)
        return host

    try:
        yield a, add_node
    finally:
        hosts.stop_together(used, grace_s=3.0)
        hosts.wait_until_quiet(a, a)


@pytest.mark.timeout(1500)
def test_an_engine_the_reference_and_a_reward_model_lost_with_their_host_cost_no_step_and_come_back(
        cluster, tiny_model_dir, scoring_rm, tmp_path):
    a, add_node = cluster
    # The head (3 CPUs) holds the learner rank (2 CPUs) and one engine (1 CPU); host b (2 CPUs) the other engine,
    # the reference actor and the reward model (half a CPU each). Ray's PACK fills the bigger node first: with
    # host b as big as the head, the learner rank landed there in one run of two.
    b = add_node(cpus=2)
    run_dir = tmp_path / "run"
    console = tmp_path / "train.log"
    # Many steps of a fraction of a second each: the run is stopped (SIGTERM: checkpoint, exit 143) once the
    # lost engine is back and has generated, however long its reload took.
    with training(a, tiny_model_dir, run_dir, 5000, ["rollout.num_workers=2", "rollout.min_workers=1",
                                                   "checkpoint.every=0", "algo.beta=0.04",
                                                   "reference.placement=actor", "reference.num_cpus=0.5",
                                                   f"reward.functions=[exact_match,model:{scoring_rm}]",
                                                   "reward.model_num_cpus=0.5"],
                  console) as proc:
        # Host c, with room for all three actors of host b, joins while the actors load (each was asked of
        # Ray on its chosen node before "starting ..." is said; the placement assertions below would catch one
        # on c), so that its `ray start` is not waited out after the loss. Joining after the kill, it was up
        # before Ray said host b dead (~14 s after the kill with Ray's default health checks) all the same:
        # the reference and the reward model restart there at once, the lost engine comes back there.
        wait_until(lambda: "each says what it waits on" in console.read_text(), proc, console, 600)
        joined: list[hosts.Host] = []
        joining = threading.Thread(target=lambda: joined.append(add_node(cpus=2)), daemon=True)
        joining.start()
        wait_rows(proc, run_dir, 2, console)
        listed = json.loads((run_dir / "placement.json").read_text())
        placement = {p["role"]: p for p in listed}
        on_b = on(b, listed)
        assert len(on_b) == 3 and on_b[0] == "reference" and on_b[1].startswith("reward-") \
            and on_b[2].startswith("rollout-"), placement
        assert {placement[r]["pid"] for r in on_b} <= set(b.pids())  # the hostname they reported is their host's
        joining.join(timeout=600)
        assert joined, "host c's Ray node did not start (see ray_nodes.log)"
        c = joined[0]
        lost_at = len(host_runs.train_rows(run_dir))
        b.kill_all()
        wait_until(lambda: "rejoined on" in console.read_text() and host_runs.train_rows(run_dir)[-1]["rollout/live_engines"] == 2,
                   proc, console, 900)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 143, console.read_text()[-5000:]
    text, train_rows = finished(console, run_dir)
    assert [r["step"] for r in train_rows] == list(range(1, len(train_rows) + 1))  # each step once: none redone
    lost_engine = on_b[2].replace("rollout-", "rollout worker ")
    assert re.search(rf"{lost(b)}.*it held .*{lost_engine}.*\n", text), text[-5000:]
    assert re.search(rf"{lost(b)}.*it held .*reference actor", text), text[-5000:]
    assert re.search(rf"{lost(b)}.*it held .*reward model", text), text[-5000:]
    # The reward model scored every step, those after the loss too (its calls went again once Ray moved it)
    rm = f"rewards/{scoring_rm.name}"
    assert all(r[f"{rm}/errors"] == 0 and r[f"{rm}/mean"] == r[f"{rm}/mean"] for r in train_rows), \
        [(r["step"], r.get(f"{rm}/errors")) for r in train_rows]
    # The reference actor: restarted where it fits (the node that joined), said in raygrpo's words.
    assert "reference actor was lost with its host: Ray restarts it on a node with room for 0.5 CPU" in text
    assert re.search(rf"reference actor restarted on {on_host(c)} \d+s after its host was lost", text), text[-5000:]
    after = {p["role"]: p for p in json.loads((run_dir / "placement.json").read_text())}
    assert after["reference"]["pid"] != placement["reference"]["pid"]
    assert after["reference"]["node_id"] != placement["reference"]["node_id"]
    assert after["reference"]["node_id"] not in {placement["reference"]["node_id"], placement["learner-0"]["node_id"]}
    # The reward model, likewise: its new process and node in placement.json, where it runs said
    assert after[on_b[1]]["pid"] != placement[on_b[1]]["pid"] and after[on_b[1]]["node_id"] != placement[on_b[1]]["node_id"]
    # all three run on host c now, and placement.json's network view says so (not host b's, kept from the start)
    assert {after[role]["network"]["hostname"] for role in on_b} == {c.hostname}, after
    assert {after[role]["network"]["address"] for role in on_b} == {c.address}, after
    assert re.search(rf"reward model \S+ runs again on {on_host(c)}, with its threads", text), text[-5000:]
    # Ray's raw raylet lines (the node's death, the dead raylet's last log lines) stay in the run's logs
    assert "has been marked dead because" not in text and "Raylet is terminated" not in text
    assert "restarting every actor" not in text and "resumed from" not in text
    live = [r["rollout/live_engines"] for r in train_rows]
    assert live[:lost_at] == [2] * lost_at and 1 in live[lost_at:] and live[-1] == 2, live
    assert re.search(rf"{lost_engine} rejoined on {on_host(c)}", text) and "fingerprint verified" in text, text[-5000:]
    assert all(r["sync_verified"] for r in train_rows)
    assert all(r["trained_groups"] == 4 for r in train_rows)  # the lost engine's groups were regenerated


@pytest.mark.timeout(1500)
def test_a_pipeline_run_with_room_for_one_engine_adds_the_other_when_a_node_joins_and_goes_on_when_it_is_lost(
        cluster, tiny_model_dir, tmp_path):
    """An elastic start, in pipeline mode (engines that never stop): the head alone has room for the learner
    rank and one engine of two; with rollout.min_workers=1 the run starts with that one, saying what the other
    waits for, and feeds the other (the current weights sent and verified first) once a node with room joins.
    Then that node is lost: the run goes on with the first engine, no restart, no step redone, every step on
    full groups (those in flight on the lost engine generated again)."""
    a, add_node = cluster
    run_dir, console = tmp_path / "run", tmp_path / "train.log"
    with training(a, tiny_model_dir, run_dir, 5000, ["trainer.mode=pipeline", "rollout.num_workers=2",
                                                   "rollout.min_workers=1", "checkpoint.every=0"], console) as proc:
        wait_rows(proc, run_dir, 2, console)
        said = console.read_text()
        assert "no room yet for rollout worker(s) 1 (" in said and \
            "the run starts with 1 of 2 engine(s) (rollout.min_workers=1)" in said, said[-3000:]
        joined_at = len(host_runs.train_rows(run_dir))
        b = add_node(cpus=1)
        wait_until(lambda: "rollout worker 1 joined the fleet on" in console.read_text()
                   and host_runs.train_rows(run_dir)[-1]["rollout/live_engines"] == 2, proc, console, 900)
        wait_rows(proc, run_dir, len(host_runs.train_rows(run_dir)) + 3, console)  # engine 1 is fed (tests/unit/test_pipeline.py)
        placement = {p["role"]: p for p in json.loads((run_dir / "placement.json").read_text())}
        assert placement["rollout-1"]["pid"] in b.pids() and placement["rollout-1"]["network"]["hostname"] == b.hostname
        lost_at = len(host_runs.train_rows(run_dir))
        b.kill_all()
        wait_until(lambda: "rollout worker 1 left the fleet with its host" in console.read_text(), proc, console, 300)
        wait_rows(proc, run_dir, len(host_runs.train_rows(run_dir)) + 3, console)  # the run goes on with engine 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 143, console.read_text()[-5000:]
    text, train_rows = finished(console, run_dir)
    assert "fingerprint verified: 2 of 2 engine(s) generate" in text
    assert re.search(rf"{lost(b)}.*it held .*rollout worker 1", text), text[-5000:]
    assert re.search(rf"rollout worker 1 joined the fleet on {on_host(b)}", text), text[-5000:]
    assert [r["step"] for r in train_rows] == list(range(1, len(train_rows) + 1))  # each step once: none redone
    live = [r["rollout/live_engines"] for r in train_rows]
    assert live[:joined_at] == [1] * joined_at and 2 in live[joined_at:lost_at] and live[-1] == 1, live
    assert all(r["sync_verified"] for r in train_rows) and all(r["trained_groups"] == 4 for r in train_rows)
    assert all(r["rollout_restarts"] == 0 for r in train_rows)
    assert "restarting every actor" not in text and "has been marked dead because" not in text
    assert not re.search(r"^resumed from ", text, re.M), text[-5000:]
    placement = {p["role"]: p for p in json.loads((run_dir / "placement.json").read_text())}
    # in placement.json, on the node that joined
    assert placement["rollout-1"]["node_id"] not in {placement["rollout-0"]["node_id"], None}, placement


@pytest.mark.timeout(1500)
def test_colocated_placement_a_host_lost_with_a_learner_rank_and_its_engine_resumes_and_both_come_back(
        cluster, tiny_model_dir, tmp_path):
    """ray.placement=colocate: learner rank i and engine i share one bundle of the placement group (3 CPUs
    each here: the head holds bundle 0, host b bundle 1). Host b lost: the run waits for a node with room
    for the lost bundle, saying so; once one joins and Ray has moved the bundle there, the learner ranks
    restart from the newest checkpoint, the engine on the head is kept, and the lost engine comes back in
    the moved bundle with the current weights, verified. Each step is logged once. (Ray's PACK puts bundle 0
    on either node of the same size: the rank lost is 0 or 1, and with rank 0 the address where the ranks
    and the engines meet moves to the node that joined.)"""
    a, add_node = cluster
    b = add_node(cpus=3)
    run_dir, console = tmp_path / "run", tmp_path / "train.log"
    with training(a, tiny_model_dir, run_dir, 5000, ["ray.placement=colocate", "learner.num_ranks=2",
                                                     "rollout.num_workers=2", "rollout.min_workers=1",
                                                     "checkpoint.every=2"], console) as proc:
        wait_rows(proc, run_dir, 3, console)
        listed = json.loads((run_dir / "placement.json").read_text())
        before = {p["role"]: p for p in listed}
        i = int(before["learner-1"]["network"]["hostname"] == b.hostname)  # the pair of learner rank i, engine i on b
        kept = f"rollout-{1 - i}"
        assert on(b, listed) == [f"learner-{i}", f"rollout-{i}"], before
        b.kill_all()
        wait_until(lambda: f"waiting for a node with room for learner rank {i}" in console.read_text(), proc, console,
                   300)
        c = add_node(cpus=3)  # the node with room the run said it waits for
        wait_until(lambda: f"rollout worker {i} rejoined on" in console.read_text()
                   and host_runs.train_rows(run_dir)[-1]["rollout/live_engines"] == 2, proc, console, 900)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 143, console.read_text()[-5000:]
    text, train_rows = finished(console, run_dir)
    assert re.search(rf"{lost(b)}.*it held .*rollout worker {i}", text), text[-5000:]
    assert re.search(rf"{lost(b)}.*it held .*learner rank {i}", text), text[-5000:]
    assert "restarting the learner ranks and resuming from the last checkpoint" in text and "resumed from" in text
    # the room waited for is the rank's whole bundle: its engine's CPU too (a 2-CPU node would never do)
    assert f"waiting for a node with room for learner rank {i} ({{'CPU': 3.0}})" in text, text[-5000:]
    assert "restarting every actor" not in text and "has been marked dead because" not in text
    assert "Raylet is terminated" not in text
    assert [r["step"] for r in train_rows] == list(range(1, len(train_rows) + 1))  # each step logged once
    assert all(r["sync_verified"] for r in train_rows)
    after = {p["role"]: p for p in json.loads((run_dir / "placement.json").read_text())}
    assert after[kept]["pid"] == before[kept]["pid"]  # the engine on the live host was kept
    assert after[f"learner-{i}"]["pid"] != before[f"learner-{i}"]["pid"]  # the lost rank runs in a new process
    assert {after[r]["network"]["address"] for r in (f"learner-{i}", f"rollout-{i}")} == {c.address}, after
    assert {after[r]["network"]["hostname"] for r in (f"learner-{i}", f"rollout-{i}")} == {c.hostname}, after
    assert re.search(rf"rollout worker {i} rejoined on {on_host(c)}", text), text[-5000:]
    assert re.search(rf"network: {c.hostname} advertises {re.escape(c.address)}, .*: learner-{i}\n", text), text[-5000:]
