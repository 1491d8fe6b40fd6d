"""Fakes of the actors the driver calls (issue 58, item 3), one per interface, for unit tests of the driver's
decisions at its seam: fleet changes, restarts, staleness, halts, reward failures.

Each fake's public methods have the real actor's names and parameters; tests/unit/test_fake_contracts.py holds
them to it (inspect.signature on the real class), so a renamed method or a changed parameter fails there and
not silently here. What a test turns to make the driver decide (an engine that hangs, dies, comes back as a new
process, answers with old weights; a reward function that fails) is plain data on the fake (its `faults`) or a
function of this package, never a method the real actor lacks.

- ray_like.py: `handle(actor)`, a Ray-like handle (`h.method.remote(...)` gives a FakeRef) and the driver's
  wait helpers (`wait_for`, `wait_all`, `actor_state`) over such refs, patched in with `use_fake_ray`.
- engine.py: FakeEngine (actors/rollout.py RolloutWorker).
- learner.py: FakeLearnerRank (learner/worker.py LearnerWorker), driven through the real LearnerGroup.
- reference.py: FakeReference (learner/reference.py ReferenceActor).
- hosts.py: FakeHosts (cluster/launch/hosts.py HostWatch), the nodes Ray marked dead named by the test.
- scorer.py: FakeScorer (actors/rewards/scorer.py RewardScorer), its rewards combined by the real `combine`.
"""
from tests.fakes.engine import FakeEngine
from tests.fakes.hosts import FakeHosts
from tests.fakes.learner import FakeLearnerRank
from tests.fakes.ray_like import FakeRef, handle, use_fake_ray
from tests.fakes.reference import FakeReference
from tests.fakes.scorer import FakeScorer

__all__ = ["FakeEngine", "FakeHosts", "FakeLearnerRank", "FakeRef", "FakeReference", "FakeScorer", "handle", "use_fake_ray"]
