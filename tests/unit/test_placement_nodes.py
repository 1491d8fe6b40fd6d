"""Where restarted learner ranks go when no placement group holds their place (cluster/launch/placement.py
nodes_with_room): a rank keeps its node while it lives; a rank whose node was lost takes a live node with
room (what earlier ranks took counted), or the wait, said and bounded by ray.node_wait_s, names what is
missing. With fakes for Ray's node table and free resources."""
from __future__ import annotations

import pytest

from cluster.launch import placement


class Hosts:
    def room_note(self, fresh: bool = False) -> str:
        return "live nodes: 10.0.0.1 (host-a, 4 CPU)"


@pytest.fixture
def cluster(monkeypatch):
    import ray._private.state

    state = {"alive": {"a": True, "b": False}, "free": {"a": {"CPU": 2.0}}}
    monkeypatch.setattr(placement, "node_table", lambda: {n: {"alive": up, "address": f"10.0.0.{i}", "hostname": n}
                                                          for i, (n, up) in enumerate(state["alive"].items(), 1)})
    monkeypatch.setattr(ray._private.state, "available_resources_per_node",
                        lambda: {n: r for n, r in state["free"].items() if state["alive"].get(n)})
    monkeypatch.setattr(placement.time, "sleep", lambda s: None)
    return state


def test_a_rank_whose_node_lives_keeps_it_and_a_lost_one_takes_a_node_with_room(cluster):
    cluster["alive"]["c"], cluster["free"]["c"] = True, {"CPU": 2.0}
    # a's 2 free CPUs are rank 0's own (its process is gone): not room for rank 1 too
    assert placement.nodes_with_room(["a", "b"], {"CPU": 2.0}, 60, Hosts()) == ["a", "c"]
    cluster["free"]["a"] = {"CPU": 4.0}
    assert placement.nodes_with_room(["a", "b"], {"CPU": 2.0}, 60, Hosts()) == ["a", "a"]


def test_two_lost_ranks_do_not_take_the_same_room(cluster, monkeypatch):
    cluster["alive"].update(c=True, d=True)
    cluster["free"].update(a={}, c={"CPU": 2.0}, d={"CPU": 2.0})
    assert sorted(placement.nodes_with_room(["b", "b"], {"CPU": 2.0}, 60, Hosts())) == ["c", "d"]


def test_no_room_waits_saying_so_then_fails_naming_the_rank(cluster, monkeypatch, capsys):
    clock = iter(range(0, 10_000, 7))
    monkeypatch.setattr(placement.time, "monotonic", lambda: float(next(clock)))
    with pytest.raises(RuntimeError) as e:
        placement.nodes_with_room(["a", "b"], {"CPU": 2.0}, 60, Hosts())
    assert "no node with room for learner rank 1 ({'CPU': 2.0})" in str(e.value) and "ray.node_wait_s=60s" in str(e.value)
    assert "waiting for a node with room for learner rank 1 ({'CPU': 2.0})" in capsys.readouterr().out
