"""A weight update that an engine fails (cluster/driver/engine_weights.py EngineWeights.update), and how the
driver tells a learner rank's death from a learner whose own call to an engine failed.

The case CI met (issue 39): a partition of an engine's host healed before Ray marked the host dead. The
learner's connection to that engine was left reset, so its first call there (the transfer's init) failed
with ActorUnavailableError, which Ray hands on typed as its cause. The driver took it for the learner's
death, waited 60 s for Ray to say so, and restarted the learner from step 0.
"""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

import actors.runtime.waits as waits
import cluster.driver.engine_weights as engine_weights
from actors.runtime.waits import actor_died
from cluster.config import RunConfig
from cluster.driver.comebacks import Comebacks
from cluster.driver.engine_weights import ENGINE_UPDATE_TRIES, EngineWeights, WeightVersions
from cluster.launch.waits import ActorFailed


def unavailable() -> Exception:
    from ray.exceptions import ActorUnavailableError

    return ActorUnavailableError("The actor 0869 is unavailable: RpcError: recvmsg:Connection reset by peer", b"\0" * 16)


def raised_by_the_learner(cause: Exception) -> Exception:
    """What ray.get gives the driver when the learner's own code raised `cause`."""
    from ray.exceptions import RayTaskError

    return RayTaskError("LearnerWorker.init_weight_sync", "Traceback ...", cause).as_instanceof_cause()


def test_an_actor_that_raised_a_callees_error_did_not_die():
    from ray.exceptions import ActorUnavailableError

    cut = raised_by_the_learner(unavailable())
    assert isinstance(cut, ActorUnavailableError)  # Ray's typing: why the driver took it for the learner's death
    assert not actor_died(cut)
    assert actor_died(unavailable())  # the call to the actor itself found it unavailable
    assert not actor_died(ValueError("its own bug"))


class Learners:
    """Fake learner group: init and sync fail with the queued errors, in order, then succeed."""

    def __init__(self, failures):
        self.failures, self.calls = list(failures), []

    def _call(self, what):
        self.calls.append(what)
        if self.failures and self.failures[0][0] == what:
            raise self.failures.pop(0)[1]

    def init_weight_sync(self, handles, backend, bucket_mb, tensor_parallel):
        self._call("init")

    def sync_weights(self, version, watch=None):
        self._call("sync")
        return {"bytes": 1, "verified": True, "weight_version": version}


class Pool:
    def __init__(self, changed=False):
        self.changed, self.checked, self.fleet_changed, self.live_handles = changed, 0, False, ["e0", "e1"]

    def recover_all(self):
        self.checked += 1
        return self.changed


def weights(learners, pool) -> EngineWeights:
    return EngineWeights(RunConfig(), WeightVersions(learner=4, sent=3), "gloo", pool, learners, {},
                         SimpleNamespace(check=lambda: []), threading.RLock())


def test_an_engine_connection_cut_under_the_learner_goes_again_with_no_learner_restart(capsys):
    learners, pool = Learners([("init", raised_by_the_learner(unavailable()))]), Pool(changed=False)
    w = weights(learners, pool)
    out = w.update(rebuild=True)
    assert out["verified"] and w.versions.sent == 4
    assert learners.calls == ["init", "init", "sync"] and pool.checked == 1  # the engines were checked first
    said = capsys.readouterr().out
    assert "sending weights version 4 to the rollout engines failed" in said and "Connection reset by peer" in said
    assert f"(2/{ENGINE_UPDATE_TRIES})" in said


def test_a_failed_transfer_is_rebuilt_before_it_goes_again():
    learners = Learners([("sync", RuntimeError("the weight sender gave up")), ])
    weights(learners, Pool(changed=True)).update()  # the pool revived (or dropped) an engine
    assert learners.calls == ["sync", "init", "sync"]  # the failed group is gone: a new init first


def test_a_learner_ranks_death_is_raised_for_the_restart_not_retried():
    died = ActorFailed("learner rank 0", "sending weights version 4 to the engines", died=True, detail="killed")
    learners, pool = Learners([("sync", died)]), Pool(changed=False)
    with pytest.raises(ActorFailed) as e:
        weights(learners, pool).update()
    assert e.value is died and learners.calls == ["sync"] and pool.checked == 1


def test_an_error_no_engine_explains_is_raised_and_a_lasting_cut_stops_after_the_tries():
    from ray.exceptions import ActorUnavailableError

    learners = Learners([("init", ValueError("bad bucket size"))])
    with pytest.raises(ValueError):
        weights(learners, Pool()).update(send=False, rebuild=True)
    assert learners.calls == ["init"]
    cut = raised_by_the_learner(unavailable())
    learners = Learners([("init", cut)] * ENGINE_UPDATE_TRIES)
    with pytest.raises(ActorUnavailableError):
        weights(learners, Pool()).update(send=False, rebuild=True)
    assert learners.calls == ["init"] * ENGINE_UPDATE_TRIES


def test_the_sender_calls_every_engine_before_the_init_asking_again_while_ray_says_unavailable(monkeypatch):
    import ray
    from ray.exceptions import ActorUnavailableError

    answers = {"e0": [unavailable(), unavailable(), {"pid": 1}], "e1": [{"pid": 2}]}

    def get(ref, timeout=None):
        answer = answers[ref].pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    handles = [SimpleNamespace(info=SimpleNamespace(remote=lambda name=name: name)) for name in answers]
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(waits.time, "sleep", lambda s: None)
    waits.reach_actors(handles, timeout_s=5)
    assert answers == {"e0": [], "e1": []}

    answers["e0"] = [unavailable()] * 1000  # gone for good: raised within the bound
    clock = iter(range(0, 10_000, 1))
    monkeypatch.setattr(waits.time, "monotonic", lambda: next(clock))
    with pytest.raises(ActorUnavailableError):
        waits.reach_actors(handles[:1], timeout_s=5)


def test_an_engine_back_is_said_with_its_pids_so_the_same_process_claim_can_be_checked(capsys):
    """Issue 59, item 5: "rollout worker 1 answers again as the same process" was printed for an engine that had been
    killed (pid 22094 became 23091). The lines name the pids now: the pool's record before and after the revive."""
    w = weights(Learners([]), Pool())
    w.resync = lambda worker_index=None: None
    w.pool.pid_before, w.pool.pids = [11, 22094], [11, 23091]
    w.restarted(1, new_process=True)
    w.pool.pid_before = [11, 23091]
    w.restarted(1, new_process=False)
    said = capsys.readouterr().out.splitlines()
    assert said[0].startswith("rollout worker 1 restarted as a new process (pid 22094 -> 23091); re-syncing weights")
    assert said[1].startswith("rollout worker 1 answers again as the process the driver last knew (pid 23091;")
    assert "the same process" not in "\n".join(said)


def test_an_update_the_learner_timed_out_on_goes_again_when_the_hung_engine_answers_again(capsys):
    """Issue 59, item 3, seen end to end: engine 1 SIGSTOPped mid-transfer; the learner's send timed out (its call not
    answered within trainer.actor_timeout_s), the engine answered again when the fleet was checked (SIGCONT), and the
    run failed on the learner's timeout though nothing was wrong any more. The update goes again, rebuilt."""
    silent = ActorFailed("learner rank 0", "sending weights version 4 to the engines", died=False,
                         detail="no answer within 200s")
    learners, pool = Learners([("sync", silent)]), Pool(changed=False)
    out = weights(learners, pool).update()
    assert out["verified"] and learners.calls == ["sync", "init", "sync"] and pool.checked == 1
    assert "sending weights version 4 to the rollout engines failed" in capsys.readouterr().out


def test_an_engine_back_in_the_fleet_gets_its_threads_then_the_current_weights_verified(monkeypatch):
    """A rejoined engine (its host back, or an elastic start's engine placed at last) must not generate with the
    weights it had: the transfer group is rebuilt with it and version 4 sent and checked (issue 58: deleting
    this re-sync was caught by no test)."""
    learners, asked = Learners([]), []
    pool = Pool()
    pool.handles = [None, SimpleNamespace(set_threads=SimpleNamespace(remote=lambda n: ("set_threads", n)))]
    w = weights(learners, pool)
    monkeypatch.setattr(engine_weights, "wait_for", lambda ref, *args, **kw: asked.append(ref))
    w.rejoined(1)
    assert asked == [("set_threads", w.threads["rollout-1"])] and w.threads["rollout-1"] >= 1
    assert learners.calls == ["init", "sync"] and w.versions.sent == 4  # rebuilt with it, then the weights, verified


def test_the_pools_on_rejoin_records_where_the_engine_runs_and_sends_it_the_weights():
    rejoined, rows, said = [], {"rollout-1": {"role": "rollout-1"}}, []
    placement = SimpleNamespace(row=rows.__getitem__, say_network=said.append)
    back = Comebacks(actors=None, placement=placement, hosts=None, threads={"rollout-1": 1},
                     weights=SimpleNamespace(rejoined=rejoined.append), scorer=None, pool=None, timeout_s=5)
    back.engine_up(1, {"pid": 555, "node_id": "n2", "hostname": "host-b"})
    assert rejoined == [1]  # the weights (EngineWeights.rejoined: the re-sync above)
    assert rows["rollout-1"] == {"role": "rollout-1", "pid": 555, "node_id": "n2", "hostname": "host-b", "threads": 1}
    assert said == [["rollout-1"]]
