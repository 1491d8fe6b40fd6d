"""The elastic engine fleet (cluster/driver/rollout_pool.py) with fake engine handles: an engine lost
with its host leaves the fleet and its prompts go to the others in the same call; below
rollout.min_workers the pool waits for a node with room (bounded, said) and then fails naming it;
an engine Ray placed again gets the weights (on_rejoin) before it is given prompts; a crash on a live
host is still a restart in place."""
from __future__ import annotations

import pytest

from actors.completions import PromptRollout
from actors.runtime import waits
from cluster.driver import rollout_pool
from cluster.driver.rollout_pool import RolloutPool
from cluster.launch.waits import ActorFailed


class Engine:
    """A fake engine handle: `.generate.remote(...)` and `.info.remote()` return their answers (the fake
    wait_for below hands them back, or raises for an engine marked dead)."""

    def __init__(self, index: int, pid: int):
        self.index, self.pid, self.dead, self.served = index, pid, False, []
        engine = self

        class generate:  # noqa: N801 - a Ray handle's method
            @staticmethod
            def remote(prompts, group_size, seeds, greedy):
                engine.served.append(list(seeds))
                return engine, [PromptRollout(p, [1], [], weight_version=0) for p in prompts]

        class info:  # noqa: N801
            @staticmethod
            def remote():
                return engine, {"pid": engine.pid, "node_id": f"node-{engine.pid}"}

        self.generate, self.info = generate, info


class Hosts:
    """A fake HostWatch: the actors named in `lost` are on a dead host."""

    def __init__(self):
        self.lost, self.placed = set(), {}

    def host_lost(self, actor):
        return actor in self.lost

    def place(self, actor, node):
        self.placed[actor] = node

    def describe(self, actor):
        return f"127.0.0.1 (host, Ray node {self.placed.get(actor)})"

    def room_note(self):
        return "live nodes: 127.0.0.1 (host-a, 3 CPU)"


@pytest.fixture
def fakes(monkeypatch):
    states = {}

    def wait_for(ref, actor, what, timeout_s, bound=None, probe=None):
        engine, answer = ref
        if engine.dead:
            raise ActorFailed(actor, what, died=True, detail="killed")
        return answer

    monkeypatch.setattr(rollout_pool, "wait_for", wait_for)
    monkeypatch.setattr(rollout_pool, "actor_state", lambda h: (states.get(h.index, "ALIVE"), 0))
    monkeypatch.setattr(rollout_pool.time, "sleep", lambda s: None)
    return states


def pool_of(n, hosts, min_live, events, node_wait_s=300.0, live=None):
    engines = [Engine(i, 100 + i) for i in range(n)]
    def restarted(w, new_process):
        events.append(("restart" if new_process else "answers again", w))

    pids = [e.pid if live is None or i in live else None for i, e in enumerate(engines)]
    return engines, RolloutPool(engines, 10.0, restarted, pids,
                                on_rejoin=lambda w, info: events.append(("rejoin", w, info["pid"])), hosts=hosts,
                                min_live=min_live, node_wait_s=node_wait_s, bundle={"CPU": 1}, live=live)


def answer_when_restarting(monkeypatch, may=lambda engine: True) -> None:
    """A dead engine asked how its restart goes answers again (as the same process unless its pid was changed),
    where `may(engine)` says so."""
    original = rollout_pool.wait_for

    def wait_for(ref, actor, what, timeout_s, bound=None, probe=None):
        engine, _ = ref
        if engine.dead and what == "restarting" and may(engine):
            engine.dead = False
        return original(ref, actor, what, timeout_s, bound)

    monkeypatch.setattr(rollout_pool, "wait_for", wait_for)


def test_an_engine_lost_with_its_host_leaves_and_its_prompts_go_to_the_survivors(fakes, capsys):
    hosts, events = Hosts(), []
    engines, pool = pool_of(2, hosts, 1, events)
    engines[1].dead, hosts.lost = True, {"rollout worker 1"}
    fakes[1] = "RESTARTING"
    out = pool.generate([[i] for i in range(4)], 1, [10, 11, 12, 13])
    assert [r.prompt for r in out] == [[0], [1], [2], [3]]  # every prompt, in order
    assert pool.live == [0] and pool.fleet_changed and events == []  # no restart, nothing waited for
    assert engines[0].served == [[10, 11], [12, 13]]  # its own share, then the lost engine's (same seeds)
    assert "rollout worker 1 left the fleet with its host: 1 of 2 engine(s) generate (rollout.min_workers=1)" \
        in capsys.readouterr().out
    pool.generate([[0], [1]], 1, [20, 21])
    assert engines[0].served[-1] == [20, 21] and pool.live == [0]  # while it is away, the survivor takes all

    # Ray placed it again on a node that joined: it gets the weights before it is given prompts
    engines[1].dead, engines[1].pid, fakes[1] = False, 555, "ALIVE"
    pool.generate([[0], [1]], 1, [30, 31])
    assert events == [("rejoin", 1, 555)] and pool.live == [0, 1] and pool.pids[1] == 555
    assert engines[0].served[-1] == [30] and engines[1].served[-1] == [31]
    assert "rollout worker 1 rejoined on 127.0.0.1" in capsys.readouterr().out


def test_below_min_workers_the_pool_waits_for_room_then_fails_naming_what_is_missing(fakes, capsys, monkeypatch):
    hosts, events = Hosts(), []
    engines, pool = pool_of(2, hosts, 2, events, node_wait_s=60)
    clock = iter(range(0, 10_000, 7))
    monkeypatch.setattr(rollout_pool.time, "monotonic", lambda: float(next(clock)))
    engines[1].dead, hosts.lost, fakes[1] = True, {"rollout worker 1"}, "RESTARTING"
    with pytest.raises(ActorFailed) as e:
        pool.generate([[i] for i in range(2)], 1, [0, 1])
    msg = str(e.value)
    assert "rollout worker 1" in msg and "rollout.min_workers=2" in msg and "ray.node_wait_s=60s" in msg
    assert "{'CPU': 1}" in msg and "live nodes: 127.0.0.1" in msg
    said = capsys.readouterr().out
    assert "waiting for a node with room for rollout worker(s) 1 ({'CPU': 1} each): 1 of 2 engine(s) live" in said


def test_a_crash_on_a_live_host_is_still_a_restart_in_place(fakes, monkeypatch):
    hosts, events = Hosts(), []
    engines, pool = pool_of(2, hosts, 1, events)
    engines[0].dead, engines[0].pid = True, 777  # the call it is in fails; Ray restarts it as pid 777
    answer_when_restarting(monkeypatch)
    out = pool.generate([[i] for i in range(4)], 1, [0, 1, 2, 3])
    assert len(out) == 4 and events == [("restart", 0)] and pool.live == [0, 1] and pool.pids[0] == 777
    assert pool.pid_before[0] == 100  # what the restart's line names as the process it replaced (issue 59)
    assert engines[0].served[-1] == [0, 1]  # its own share again, same seeds
    assert pool.restarts == 1


def test_a_call_lost_with_its_connection_is_not_counted_as_a_restart(fakes, monkeypatch):
    """The call failed (Ray lost the connection: a partition that healed) but the same process answers:
    re-synced and its share sent again, said as such, and not counted in rollout_restarts."""
    hosts, events = Hosts(), []
    engines, pool = pool_of(2, hosts, 1, events)
    engines[0].dead = True
    answer_when_restarting(monkeypatch)  # the same pid
    out = pool.generate([[i] for i in range(4)], 1, [0, 1, 2, 3])
    assert len(out) == 4 and events == [("answers again", 0)] and pool.live == [0, 1] and pool.pids[0] == 100
    assert engines[0].served[-1] == [0, 1] and pool.restarts == 0


def test_an_elastic_start_takes_an_engine_into_the_fleet_when_it_starts(fakes, capsys):
    """An engine an elastic start had no room for (cluster/launch/placement.py) is pending on Ray: the run
    generates without it; once a node with room joins and it starts, it gets the weights, then its share."""
    hosts, events = Hosts(), []
    engines, pool = pool_of(2, hosts, 1, events, live=[0])
    fakes[1] = "PENDING_CREATION"
    pool.generate([[0], [1]], 1, [10, 11])
    assert engines[0].served == [[10, 11]] and engines[1].served == [] and pool.live == [0] and events == []
    fakes[1] = "ALIVE"  # a node with room joined; its vLLM engine loaded
    pool.generate([[0], [1]], 1, [20, 21])
    assert events == [("rejoin", 1, 101)] and pool.live == [0, 1] and pool.pids[1] == 101
    assert engines[0].served[-1] == [20] and engines[1].served == [[21]]
    assert "rollout worker 1 joined the fleet on 127.0.0.1" in capsys.readouterr().out
    assert pool.restarts == 0


def test_an_engine_whose_host_is_lost_while_it_is_revived_leaves_once_and_its_prompts_go_to_the_survivors(
        fakes, capsys, monkeypatch):
    """A partition (tests/e2e/test_partition.py, a run of the suite on 2026-11-28): engine 1's call failed, then it
    answered as the same process, and the re-sync its revival runs found its host marked dead after all: the update's
    own recovery took it out of the fleet. The call that was being recovered must neither send it its prompts again
    nor take it out twice ("list.remove(x): x not in list" ended the run): its share goes to the survivor."""
    hosts, events = Hosts(), []
    engines, pool = pool_of(2, hosts, 1, events)
    engines[1].dead = True
    answer_when_restarting(monkeypatch, may=lambda engine: not hosts.lost)  # the same pid, until its host is found lost

    def resync_finds_the_host_lost(w, new_process):
        events.append(("answers again", w))
        engines[w].dead, hosts.lost = True, {f"rollout worker {w}"}
        pool.recover_all()  # what EngineWeights.update does when the transfer to it fails

    pool.on_restart = resync_finds_the_host_lost
    out = pool.generate([[i] for i in range(4)], 1, [0, 1, 2, 3])
    assert [r.prompt for r in out] == [[0], [1], [2], [3]] and pool.live == [0]
    assert events == [("answers again", 1)]
    assert engines[0].served == [[0, 1], [2, 3]]  # its own share, then engine 1's, the same seeds
    assert capsys.readouterr().out.count("rollout worker 1 left the fleet") == 1


def test_an_engine_already_out_of_the_fleet_leaves_no_second_time(fakes, capsys):
    hosts, events = Hosts(), []
    engines, pool = pool_of(3, hosts, 1, events)
    pool.leave(2)
    pool.leave(2)
    assert pool.live == [0, 1] and capsys.readouterr().out.count("left the fleet") == 1


def test_an_engine_dead_past_its_budget_on_a_live_node_leaves_the_fleet_as_a_lost_hosts_does(fakes, capsys):
    """Issue 59, item 3: an engine that crashed past rollout.max_restarts on a live node failed the run, where one lost
    with its host leaves the fleet down to rollout.min_workers."""
    hosts, events = Hosts(), []
    engines, pool = pool_of(2, hosts, 1, events)
    engines[1].dead = True
    fakes[1] = "DEAD"  # Ray will not restart it: its budget is spent
    out = pool.generate([[i] for i in range(4)], 1, [0, 1, 2, 3])
    assert len(out) == 4 and pool.live == [0] and engines[0].served[-1] == [2, 3]  # its share went to engine 0
    assert "rollout worker 1 left the fleet (died for good: Ray restarted it 0 time(s)" in capsys.readouterr().out
    pool2_engines, pool2 = pool_of(2, hosts, 2, events)  # at rollout.min_workers: the run fails, naming the key
    pool2_engines[1].dead = True
    with pytest.raises(ActorFailed, match="fewer than rollout.min_workers=2 engine"):
        pool2.generate([[i] for i in range(4)], 1, [0, 1, 2, 3])


def test_a_hung_engine_leaves_the_fleet_and_rejoins_with_the_weights_when_it_answers_again(fakes, monkeypatch, capsys):
    """Issue 59, item 3: a SIGSTOPped engine past trainer.actor_timeout_s failed the run. It leaves the fleet (its
    prompts to the others), is asked without waiting while it stays silent, and rejoins once it answers (on_rejoin
    sends the weights, verified, before it is given prompts)."""
    hosts, events = Hosts(), []
    engines, pool = pool_of(2, hosts, 1, events)
    stopped = {1}
    waits = []
    original = rollout_pool.wait_for

    def wait_for(ref, actor, what, timeout_s, bound=None, probe=None):
        engine, _ = ref
        waits.append((engine.index, what, timeout_s))
        if engine.index in stopped:
            raise ActorFailed(actor, what, died=False, detail=f"no answer within {timeout_s:.0f}s")
        return original(ref, actor, what, timeout_s, bound)

    monkeypatch.setattr(rollout_pool, "wait_for", wait_for)
    questions = []
    ask = engines[1].info.remote
    monkeypatch.setattr(engines[1].info, "remote", lambda: questions.append(1) or ask())
    out = pool.generate([[i] for i in range(4)], 1, [0, 1, 2, 3])
    assert len(out) == 4 and pool.live == [0] and engines[0].served[-1] == [2, 3]
    assert "rollout worker 1 left the fleet (it answered nothing within 10s, trainer.actor_timeout_s: hung" in \
        capsys.readouterr().out
    pool.generate([[0]], 1, [0])  # still silent: asked once for REJOIN_ANSWER_S, then only looked at
    pool.generate([[0]], 1, [0])
    asked = [t for i, what, t in waits if i == 1 and what == "coming back"]
    assert asked[0] == rollout_pool.REJOIN_ANSWER_S and all(t < 1 for t in asked[1:]) and len(asked) == 2
    assert len(questions) == 1  # one question, its answer looked for each time: no queue of them behind the hang
    stopped.clear()  # SIGCONT
    assert pool.rejoin() == [1] and pool.live == [0, 1] and ("rejoin", 1, 101) in events


def test_a_hung_engine_at_min_workers_fails_the_run_naming_it(fakes, monkeypatch):
    hosts, events = Hosts(), []
    engines, pool = pool_of(2, hosts, 2, events)

    def wait_for(ref, actor, what, timeout_s, bound=None, probe=None):
        raise ActorFailed(actor, what, died=False, detail="no answer")

    monkeypatch.setattr(rollout_pool, "wait_for", wait_for)
    with pytest.raises(ActorFailed, match="rollout worker 0"):
        pool.generate([[i] for i in range(4)], 1, [0, 1, 2, 3])


def test_an_engine_silent_when_a_failed_update_checks_the_fleet_leaves_it(fakes, monkeypatch):
    """A weight update that failed asks every engine (recover_all): one that answers nothing in time leaves the fleet
    (the update goes again to the others) instead of failing the run."""
    hosts, events = Hosts(), []
    engines, pool = pool_of(2, hosts, 1, events)
    original = rollout_pool.wait_for

    def wait_for(ref, actor, what, timeout_s, bound=None, probe=None):
        if ref[0].index == 1:
            raise ActorFailed(actor, what, died=False, detail="no answer")
        return original(ref, actor, what, timeout_s, bound)

    monkeypatch.setattr(rollout_pool, "wait_for", wait_for)
    assert pool.recover_all() is True and pool.live == [0] and pool.fleet_changed


def test_the_wait_for_an_engine_coming_back_names_its_own_bound_not_actor_timeout_s(fakes, monkeypatch, capsys):
    """The rejoin's question waits REJOIN_ANSWER_S (30 s), a fixed bound: its waiting line and its error said
    "at most trainer.actor_timeout_s=30s", a key set to something else (issue 59's small item)."""
    import ray
    from ray.exceptions import GetTimeoutError

    def silent(ref, timeout=None):
        raise GetTimeoutError("not yet")

    clock = iter(range(10_000))  # each look at the clock is 1 s later
    monkeypatch.setattr(ray, "get", silent)
    monkeypatch.setattr(waits.time, "monotonic", lambda: float(next(clock)))
    monkeypatch.setattr(rollout_pool, "wait_for", waits.wait_for)  # the real one, over the silent ray.get
    hosts, events = Hosts(), []
    engines, pool = pool_of(2, hosts, 1, events, live=[0])
    assert pool.rejoin() == [] and pool.live == [0]  # still silent: looked at again next time
    said = capsys.readouterr().err
    assert "waiting on rollout worker 1 (coming back)" in said, said
    assert f"at most 30s ({rollout_pool.REJOIN_BOUND})" in said and "trainer.actor_timeout_s=30s" not in said, said
    with pytest.raises(ActorFailed, match=r"no answer within 30s \(the fixed wait") as failed:
        waits.wait_for(object(), "rollout worker 1", "coming back", rollout_pool.REJOIN_ANSWER_S,
                       bound=rollout_pool.REJOIN_BOUND)
    assert "raise trainer.actor_timeout_s" not in str(failed.value)
