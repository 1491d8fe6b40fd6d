"""The placement group's bundles by actor kind (cluster/launch/placement.py plan_bundles) and the elastic
start that tries one engine fewer while there is no room (place_bundles), with a fake of Ray's placement
group that is ready only when its bundles fit a given number of CPUs."""
from __future__ import annotations

import importlib

import pytest

from cluster.config import load_config
from cluster.launch import placement


def _cfg(*overrides: str):
    return load_config(None, ["learner.num_ranks=2", "rollout.num_workers=3", "learner.num_cpus=1",
                              "rollout.num_cpus=2", "reference.num_cpus=0.5", "reward.model_num_cpus=0.25",
                              *overrides], validate_paths=False)


def test_separate_gives_each_actor_its_own_bundle_in_order():
    plan = placement.plan_bundles(_cfg(), 3, with_reference=True, num_reward_models=2)
    assert plan.learners == [0, 1] and plan.rollouts == [2, 3, 4] and plan.reference == 5
    assert plan.reward_models == [6, 7]
    assert [b["CPU"] for b in plan.bundles] == [1, 1, 2, 2, 2, 0.5, 0.25, 0.25]
    assert all("GPU" not in b for b in plan.bundles)  # no GPU key when none is asked for


def test_colocate_shares_rank_i_and_engine_i_and_the_extra_engines_get_their_own():
    plan = placement.plan_bundles(_cfg("ray.placement=colocate"), 3, with_reference=False, num_reward_models=0)
    assert plan.learners == [0, 1] and plan.rollouts == [0, 1, 2] and plan.reference is None
    assert [b["CPU"] for b in plan.bundles] == [3, 3, 2]


class FakeGroup:
    def __init__(self, bundles, strategy):
        self.bundles, self.strategy = bundles, strategy

    def ready(self):
        return self


@pytest.fixture
def fake_ray(monkeypatch):
    """A cluster with `room` CPUs: a group is ready when its bundles fit, else ray.get times out."""
    import ray

    pg_module = importlib.import_module("ray.util.placement_group")  # the module (ray.util's name is the function)

    state = {"room": 100.0, "tried": [], "removed": 0, "timeouts": []}

    def get(group, timeout):
        state["tried"].append(len(group.bundles))
        if sum(b["CPU"] for b in group.bundles) > state["room"]:
            state["timeouts"].append(timeout)
            raise ray.exceptions.GetTimeoutError("no room")
        return True

    monkeypatch.setattr(pg_module, "placement_group", FakeGroup)
    monkeypatch.setattr(pg_module, "remove_placement_group", lambda g: state.update(removed=state["removed"] + 1))
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": state["room"]})
    return state


def test_an_elastic_start_tries_one_engine_fewer_down_to_min_workers(fake_ray):
    fake_ray["room"] = 1 + 1 + 2  # two learner ranks and one engine
    cfg = _cfg("rollout.min_workers=1", "trainer.actor_timeout_s=30")
    group, plan, engines = placement.place_bundles(cfg, with_reference=False, num_reward_models=0)
    assert engines == 1 and plan.rollouts == [2] and group.bundles == plan.bundles
    assert fake_ray["tried"] == [5, 4, 3] and fake_ray["removed"] == 2
    # the tries before the last wait ELASTIC_TRY_S, the last the whole actor timeout
    assert fake_ray["timeouts"] == [placement.ELASTIC_TRY_S] * 2


def test_no_room_even_for_the_fewest_engines_names_the_bundles_and_what_to_lower(fake_ray):
    fake_ray["room"] = 1
    with pytest.raises(RuntimeError, match=r"could not place 4 bundles .* within 30s.*rollout.min_workers"):
        placement.place_bundles(_cfg("rollout.min_workers=2", "trainer.actor_timeout_s=30"), with_reference=False,
                                num_reward_models=0)
    assert fake_ray["tried"] == [5, 4] and fake_ray["timeouts"] == [placement.ELASTIC_TRY_S, 30]


def test_colocate_is_never_elastic(fake_ray):
    fake_ray["room"] = 1
    with pytest.raises(RuntimeError) as e:
        placement.place_bundles(_cfg("ray.placement=colocate", "rollout.min_workers=1"), with_reference=False,
                                num_reward_models=0)
    assert fake_ray["tried"] == [3] and "min_workers" not in str(e.value)
