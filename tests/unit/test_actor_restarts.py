"""The reference actor after its host was lost (cluster/driver/actor_restarts.py), with a fake HostWatch and
fake Ray object refs: the wait on its call says the loss and what it waits for (a node with room for its
bundle, at most ray.node_wait_s), where the actor came back, hands the new process to `on_back`, and then
gets the call's answer; with no room in time it fails naming the bound."""
from __future__ import annotations

import pytest

from cluster.driver import actor_restarts
from cluster.driver.actor_restarts import RestartWatch
from cluster.driver.reference import ReferenceLogprobs
from cluster.launch.waits import ActorFailed


class Ref:
    """A fake object ref: not ready for `pending` gets, then `value`."""

    def __init__(self, value, pending: int = 0):
        self.value, self.pending = value, pending


class Reference:
    """A fake reference actor handle: info() answers once Ray has restarted it (after `restart_gets` gets)."""

    def __init__(self, restart_gets: int):
        ref = Ref({"pid": 222, "node_id": "node-c"}, restart_gets)

        class info:  # noqa: N801 - a Ray handle's method
            @staticmethod
            def remote():
                return ref

        self.info = info


class Hosts:
    """A fake HostWatch: the actors in `lost` are on a dead host until placed elsewhere."""

    def __init__(self, lost=()):
        self.lost, self.placed = set(lost), {}

    def host_lost(self, actor):
        return actor in self.lost and actor not in self.placed

    def place(self, actor, node):
        self.placed[actor] = node

    def describe(self, actor):
        return f"10.77.0.3 (host-c, Ray node {self.placed[actor]})"

    def room_note(self, fresh=False):
        return "live nodes: 10.77.0.1 (host-a, 3 CPU)"


@pytest.fixture
def fake_get(monkeypatch):
    import ray
    from ray.exceptions import GetTimeoutError

    def get(ref, timeout=None):
        if getattr(ref, "error", None) is not None:
            raise ref.error
        if ref.pending:
            ref.pending -= 1
            raise GetTimeoutError("not yet")
        return ref.value

    monkeypatch.setattr(ray, "get", get)


def test_a_lost_host_is_said_waited_out_and_the_actor_back_handed_on(fake_get, capsys):
    back = []
    watch = RestartWatch(Hosts(lost={"reference actor"}), 300.0, {"reference actor": {"CPU": 1.0}},
                         lambda name, info: back.append((name, info)))
    answer = watch.wait(lambda: Ref([[-0.5]], pending=3), Reference(restart_gets=2), "reference actor",
                        "computing reference log-probs", 600.0)
    assert answer == [[-0.5]]  # the call, run again on the restarted actor, answers
    assert back == [("reference actor", {"pid": 222, "node_id": "node-c"})]
    out = capsys.readouterr().out
    assert ("reference actor was lost with its host: Ray restarts it on a node with room for 1 CPU and runs its "
            "call again; waiting for it, at most ray.node_wait_s=300s (live nodes: 10.77.0.1 (host-a, 3 CPU))") in out
    assert "waiting for a node with room for the reference actor (1 CPU)" in out  # said while it waited
    assert "reference actor restarted on 10.77.0.3 (host-c, Ray node node-c)" in out


def test_no_node_with_room_in_time_fails_naming_the_bound(fake_get):
    watch = RestartWatch(Hosts(lost={"reference actor"}), 0.0, {"reference actor": {"CPU": 1.0}},
                         lambda name, info: None)
    with pytest.raises(ActorFailed, match=r"reference actor.*not back within ray.node_wait_s=0s: no node with room "
                                          r"for 1 CPU"):
        watch.wait(lambda: Ref([[-0.5]]), Reference(restart_gets=5), "reference actor", "computing reference log-probs", 600.0)


def test_a_live_host_is_a_plain_wait(fake_get, capsys):
    watch = RestartWatch(Hosts(), 300.0, {}, lambda name, info: pytest.fail("not restarted"))
    assert watch.wait(lambda: Ref(7, pending=2), Reference(0), "reference actor", "computing", 600.0) == 7
    assert capsys.readouterr().out == ""


def failing_first(sent: list, value, error: Exception):
    """A call (it records each send in `sent`) whose first send fails with `error`; the next ones answer `value`."""
    def call():
        sent.append(1)
        ref = Ref(value)
        if len(sent) == 1:
            ref.error = error
        return ref
    return call


def test_a_call_that_fails_on_a_broken_connection_waits_for_the_host_verdict_and_runs_again(fake_get, monkeypatch):
    """Ray's retries of the call ran out on 'connection refused' before Ray marked the host dead: the wait
    looks for that verdict (bounded), waits for the restart, and sends the call again."""
    from ray.exceptions import ActorUnavailableError

    hosts, sent = Hosts(), []
    looks = iter([False, False, True])
    hosts.host_lost = lambda actor: actor not in hosts.placed and next(looks, False)
    monkeypatch.setattr(actor_restarts.time, "sleep", lambda s: None)
    watch = RestartWatch(hosts, 300.0, {"reference actor": {"CPU": 1.0}}, lambda name, info: None)

    call = failing_first(sent, [[-0.25]], ActorUnavailableError("The actor is temporarily unavailable: refused", None))
    assert watch.wait(call, Reference(restart_gets=1), "reference actor", "computing reference log-probs", 600.0) \
        == [[-0.25]]
    assert len(sent) == 2 and hosts.placed == {"reference actor": "node-c"}


def test_a_call_whose_retries_run_out_after_the_actor_is_back_elsewhere_is_sent_again(fake_get, capsys):
    """The lost host was seen and the actor is back on another node, but Ray's retries of the call sent before
    kept going to the lost address and ran out ("failed to connect to <the old host>", seen in test_lost_host):
    the call goes again, to the live actor, and the run goes on (it used to fail, naming the actor dead)."""
    from ray.exceptions import ActorUnavailableError

    sent = []
    call = failing_first(sent, [[-0.75]], ActorUnavailableError("failed to connect to all addresses; ipv4:10.77.0.2", None))
    watch = RestartWatch(Hosts(lost={"reference actor"}), 300.0, {"reference actor": {"CPU": 1.0}},
                         lambda name, info: None)
    assert watch.wait(call, Reference(restart_gets=1), "reference actor", "computing reference log-probs", 600.0) \
        == [[-0.75]]
    assert len(sent) == 2 and "reference actor restarted on 10.77.0.3" in capsys.readouterr().out


def test_a_broken_connection_without_a_lost_host_fails_naming_the_actor(fake_get, monkeypatch):
    from ray.exceptions import ActorUnavailableError

    clock = iter(range(0, 10_000, 5))
    monkeypatch.setattr(actor_restarts.time, "monotonic", lambda: float(next(clock)))
    monkeypatch.setattr(actor_restarts.time, "sleep", lambda s: None)
    watch = RestartWatch(Hosts(), 300.0, {}, lambda name, info: pytest.fail("not restarted"))
    ref = Ref(None)
    ref.error = ActorUnavailableError("The actor is temporarily unavailable", None)
    with pytest.raises(ActorFailed, match="reference actor died while computing"):
        watch.wait(lambda: ref, Reference(0), "reference actor", "computing reference log-probs", 600.0)


class Placed(Hosts):
    """A fake HostWatch whose actors all run on one live host."""

    def describe(self, actor):
        return f"10.77.0.1 (host-a, Ray node {self.placed[actor]})"


def test_an_answer_from_a_new_process_is_said_and_handed_on_once(fake_get, capsys):
    """Ray restarted the actor in place (its process died, its host lives) and ran the call again: nothing
    failed, so the answer's process is what shows it; said once, handed to on_back once."""
    back, hosts = [], Placed()
    watch = RestartWatch(hosts, 300.0, {}, lambda name, info: back.append((name, info)),
                         pids={"reference actor": 111})
    watch.answered_by("reference actor", Reference(0), 111, 600.0)
    assert back == [] and capsys.readouterr().out == ""  # the process it started in
    watch.answered_by("reference actor", Reference(0), 222, 600.0)
    watch.answered_by("reference actor", Reference(0), 222, 600.0)
    assert back == [("reference actor", {"pid": 222, "node_id": "node-c"})]
    assert hosts.placed == {"reference actor": "node-c"}
    assert capsys.readouterr().out == ("reference actor was restarted (process 111 -> 222) on 10.77.0.1 (host-a, "
                                       "Ray node node-c); Ray ran its call again, nothing was skipped\n")


def test_an_actor_back_from_a_lost_host_is_not_reported_again_by_its_answers(fake_get, capsys):
    back = []
    watch = RestartWatch(Hosts(lost={"reference actor"}), 300.0, {"reference actor": {"CPU": 1.0}},
                         lambda name, info: back.append(name), pids={"reference actor": 111})
    out = watch.wait(lambda: Ref({"logprobs": [[-0.5]], "pid": 222}), Reference(restart_gets=1), "reference actor",
                     "computing reference log-probs", 600.0)
    watch.answered_by("reference actor", Reference(0), out["pid"], 600.0)
    assert back == ["reference actor"] and "was restarted (process" not in capsys.readouterr().out


def test_reference_logprobs_notices_a_new_process(fake_get, capsys):
    back = []
    watch = RestartWatch(Placed(), 300.0, {}, lambda name, info: back.append(info["pid"]), pids={"reference actor": 111})
    reference = Reference(0)
    answers = iter([{"logprobs": [[-0.5]], "pid": 111}, {"logprobs": [[-0.25]], "pid": 222}])

    class logprobs:  # noqa: N801 - a Ray handle's method
        @staticmethod
        def remote(prompt_ids, completion_ids):
            return Ref(next(answers))

    reference.logprobs = logprobs
    logprobs_of = ReferenceLogprobs(reference, 600.0, watch)
    assert logprobs_of([[1]], [[2]]) == [[-0.5]]
    assert logprobs_of([[1]], [[2]]) == [[-0.25]]
    assert back == [222] and "reference actor was restarted (process 111 -> 222)" in capsys.readouterr().out
