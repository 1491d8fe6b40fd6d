"""Waiting on a group of actors (cluster/launch/waits.py wait_all): the first failure ends the wait, and a
dead actor is reported as the cause even when a peer's error shows first. Real Ray actors."""
import os
import time

import pytest
import ray  # noqa: TID253 - the test's actors are declared at its top

from cluster.launch.waits import ActorFailed, wait_all


@ray.remote(num_cpus=0)
class Rank:
    def work(self, how: str, seconds: float = 0.0):
        time.sleep(seconds)
        if how == "die":
            os._exit(1)
        if how == "raise":
            raise RuntimeError("Connection closed by peer")  # what gloo says when a collective loses its peer
        return how


def ranks(n):
    handles = [Rank.remote() for _ in range(n)]
    ray.get([h.work.remote("ok") for h in handles])
    return handles


def test_a_dead_rank_ends_the_wait_at_once_while_the_others_still_block(ray_cluster):
    """Rank 0 blocks (as in a collective whose peer is gone) and rank 1 dies: the wait names rank 1
    within seconds instead of waiting out the timeout on rank 0 (list order)."""
    a, b = ranks(2)
    t0 = time.monotonic()
    with pytest.raises(ActorFailed) as e:
        wait_all([a.work.remote("ok", 60), b.work.remote("die", 0.5)], ["learner rank 0", "learner rank 1"],
                 "training a step", timeout_s=120)
    assert e.value.died and e.value.actor == "learner rank 1" and time.monotonic() - t0 < 30
    ray.kill(a)


def test_a_peer_error_caused_by_a_dead_rank_is_reported_as_the_death(ray_cluster):
    """Rank 0's collective fails first (its peer is gone), rank 1's death shows a moment later: the
    death is what restarts the run, so that is what the wait raises."""
    a, b = ranks(2)
    with pytest.raises(ActorFailed) as e:
        wait_all([a.work.remote("raise", 0.2), b.work.remote("die", 1.5)], ["learner rank 0", "learner rank 1"],
                 "training a step", timeout_s=120)
    assert e.value.died and e.value.actor == "learner rank 1"


def test_an_error_of_its_own_is_raised_as_it_is_and_results_come_in_order(ray_cluster):
    a, b = ranks(2)
    assert wait_all([a.work.remote("first", 0.5), b.work.remote("second")], ["r0", "r1"], "x", 60) == ["first", "second"]
    t0 = time.monotonic()
    with pytest.raises(Exception, match="Connection closed by peer") as e:
        wait_all([a.work.remote("ok", 0.1), b.work.remote("raise")], ["r0", "r1"], "x", 60)
    assert not isinstance(e.value, ActorFailed) and time.monotonic() - t0 < 20
    with pytest.raises(ActorFailed, match="r0 did not answer in time while x: no answer within 1s") as e:
        wait_all([a.work.remote("ok", 30), b.work.remote("ok")], ["r0", "r1"], "x", 1)
    assert not e.value.died
    for h in (a, b):
        ray.kill(h)
