"""The fakes of tests/fakes/ held to the actors they stand in for (issue 58, item 3): the driver's decisions are
unit-tested against the fakes, so a fake that drifted from its actor would let a test pass that the real run
fails. Per interface:
- every public method of the fake is a method of the real class, with the same parameters (names, kinds,
  defaults; inspect.signature): a real method renamed, or a parameter added, removed or renamed, fails here;
- every method the driver calls on that actor (its `.NAME.remote` calls and LearnerGroup's fan-out by name,
  read from cluster/driver/'s source) is on the real class and on the fake.
The real classes are imported, not started: no Ray, no vLLM (tests/unit/test_import_cost.py); torch is loaded."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from actors.rewards.scorer import RewardScorer
from actors.rollout import RolloutWorker
from cluster.launch.hosts import HostWatch
from learner.reference import ReferenceActor
from learner.worker import LearnerWorker
from tests.fakes import FakeEngine, FakeHosts, FakeLearnerRank, FakeReference, FakeScorer
from tests.fakes.ray_like import FakeActor, handle

DRIVER = Path(__file__).resolve().parents[2] / "cluster" / "driver"

# fake, the real class, the driver's modules whose `.remote` calls go to that actor
INTERFACES = {
    "rollout engine": (FakeEngine, RolloutWorker, ("rollout_pool.py", "engine_weights.py", "pipeline.py")),
    "learner rank": (FakeLearnerRank, LearnerWorker, ("worker_groups.py",)),
    "reference": (FakeReference, ReferenceActor, ("reference.py", "actor_restarts.py")),
}


def public_methods(cls) -> dict:
    """name -> function, for every public callable a class defines or inherits (object's own left out)."""
    return {n: getattr(cls, n) for n in dir(cls)
            if not n.startswith("_") and callable(getattr(cls, n)) and not hasattr(object, n)}


def parameters(fn) -> list[tuple]:
    """(name, kind, default) of each parameter: what a caller's arguments bind to (annotations aside: the fakes
    need not import what the real signatures name)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def drift(fake_cls, real_cls) -> list[str]:
    """What of the fake is not the real class's: a method it lacks, or one whose parameters differ."""
    real = public_methods(real_cls)
    problems = []
    for name, fn in public_methods(fake_cls).items():
        if name not in real:
            problems.append(f"{fake_cls.__name__}.{name}: {real_cls.__name__} has no such method")
        elif parameters(fn) != parameters(real[name]):
            problems.append(f"{fake_cls.__name__}.{name}{inspect.signature(fn)} != "
                            f"{real_cls.__name__}.{name}{inspect.signature(real[name])}")
    return problems


def remote_calls(source: str) -> set[str]:
    """Method names the source calls on an actor handle: `h.NAME.remote`, `h.NAME.options(...).remote`, and
    LearnerGroup's `self._all("NAME", ...)` (every rank's NAME)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "remote":
            target = node.value
            if isinstance(target, ast.Call) and isinstance(target.func, ast.Attribute) and target.func.attr == "options":
                target = target.func.value
            if isinstance(target, ast.Attribute):
                names.add(target.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "_all"
              and node.args and isinstance(node.args[0], ast.Constant)):
            names.add(node.args[0].value)
    return names


def called_by_the_driver(modules: tuple[str, ...]) -> set[str]:
    return set().union(*(remote_calls((DRIVER / m).read_text()) for m in modules))


@pytest.mark.parametrize("interface", INTERFACES)
def test_each_fake_actors_methods_are_its_real_actors_with_the_same_parameters(interface):
    fake, real, _ = INTERFACES[interface]
    assert public_methods(fake), fake
    assert drift(fake, real) == []


@pytest.mark.parametrize("interface", INTERFACES)
def test_every_method_the_driver_calls_on_an_actor_is_on_the_real_class_and_on_its_fake(interface):
    fake, real, modules = INTERFACES[interface]
    called = called_by_the_driver(modules)
    assert called, modules  # the scan found the calls (an empty set would make this pass for nothing)
    assert sorted(called - set(public_methods(real))) == []
    assert sorted(called - set(public_methods(fake))) == []


def test_the_fake_scorer_is_the_real_scorers_interface():
    """RewardScorer is no actor (the driver holds it), but the driver's decisions on a failed reward go through it."""
    assert drift(FakeScorer, RewardScorer) == []
    assert isinstance(inspect.getattr_static(RewardScorer, "restarts"), property)
    assert isinstance(inspect.getattr_static(FakeScorer, "restarts"), property)
    # what the driver's loop reads of its scorer (scorer.NAME, self.scorer.NAME) is on both; startup.py, which
    # builds the real scorer and checks the data with it before any actor starts, is not what the fake stands in for
    asked = {n for m in ("batch.py", "collector.py", "trainer.py", "comebacks.py", "pipeline.py")
             for n in scorer_uses((DRIVER / m).read_text())}
    assert {"score", "judge", "timeout_setting", "restarted_actors", "close", "metric_keys", "names", "restarts"} <= asked
    real = set(dir(RewardScorer)) | assigned_attributes(RewardScorer)
    assert sorted(asked - real) == []
    assert sorted(asked - set(dir(FakeScorer({"f": lambda text, fields: 1.0})))) == []


def test_the_fake_host_watch_is_the_real_ones_interface():
    assert drift(FakeHosts, HostWatch) == []
    assert "where" in assigned_attributes(HostWatch)  # the pool and the comebacks read it


def scorer_uses(source: str) -> set[str]:
    """What the source reads of the scorer: `scorer.NAME` or `self.scorer.NAME` (called or handed on)."""
    return {node.attr for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Attribute)
            and (getattr(node.value, "id", None) == "scorer" or getattr(node.value, "attr", None) == "scorer")}


def assigned_attributes(cls) -> set[str]:
    """The attributes a class's methods set on `self` (its instance's data: RewardScorer.names)."""
    nodes = list(ast.walk(ast.parse(inspect.getsource(cls))))
    assigned = [t for node in nodes if isinstance(node, ast.Assign) for t in node.targets]
    assigned += [node.target for node in nodes if isinstance(node, ast.AnnAssign)]  # self.where: dict = {}
    targets = [t for target in assigned for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
    return {t.attr for t in targets if isinstance(t, ast.Attribute) and getattr(t.value, "id", None) == "self"}


# ------------------------------------------------------------------ the contract check itself can fail
def test_the_contract_fails_for_a_method_renamed_or_a_parameter_changed_on_the_real_actor():
    class Real:
        def generate(self, prompts, group_size, seeds=None, greedy=False, max_new_tokens=None): ...

        def info(self): ...

    class Fake:
        def generate(self, prompts, group_size, seeds=None, greedy=False, max_new_tokens=None): ...

        def info(self): ...

    assert drift(Fake, Real) == []

    class RealRenamed:
        def generate_rollouts(self, prompts, group_size, seeds=None, greedy=False, max_new_tokens=None): ...

        def info(self): ...

    class RealChanged:
        def generate(self, prompts, group_size, seeds, greedy=False, max_new_tokens=None): ...  # seeds now required

        def info(self, verbose): ...

    assert drift(Fake, RealRenamed) == ["Fake.generate: RealRenamed has no such method"]
    assert [p.split(":")[0].split("(")[0] for p in drift(Fake, RealChanged)] == ["Fake.generate", "Fake.info"]


def test_the_driver_scan_finds_remote_calls_in_every_form_the_driver_writes():
    source = ("h.generate.remote(p)\nx = h.pipeline_take.remote\nh.lend_threads.options(concurrency_group='lend')"
              ".remote(1, 2)\nself._all('sync_weights', 'sending', 3)\n")
    assert remote_calls(source) == {"generate", "pipeline_take", "lend_threads", "sync_weights"}


def test_a_fake_handle_offers_only_the_fakes_methods_as_ray_offers_only_the_classs():
    engine = FakeEngine(0, 100)
    assert handle(engine).info.remote().result("rollout worker 0", "asking", 1.0)["pid"] == 100
    with pytest.raises(AttributeError, match="no remote method 'load_weights'"):
        getattr(handle(engine), "load_weights")  # noqa: B009 - the attribute access is what raises
    assert issubclass(FakeEngine, FakeActor)
