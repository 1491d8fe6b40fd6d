"""A Ray-like handle on a fake actor, and the driver's wait helpers over it.

The driver calls an actor as Ray has it, `handle.method.remote(*args)`, and waits on the ref with
cluster/launch/waits.py (`wait_for`, `wait_all`, `actor_state`). Here `handle(actor)` gives that shape: the
call is recorded when it is sent and run when it is waited on, so a fault set in between (the actor dies,
hangs, or Ray restarts it as another process) reaches the call the driver is waiting on, as it would.

An actor's faults (`Faults`, plain data; the functions below turn them):
- dead: its calls fail as a dead actor's (ActorFailed, died=True); Ray's table says `state`;
- hung: its calls get no answer within their bound (ActorFailed, died=False), as a SIGSTOPped process's;
- comes_back_as: the pid Ray restarts it as once the driver looks at Ray's table (`actor_state`); None with
  `dead`: Ray will not restart it (state DEAD: its rollout.max_restarts spent).
A call sent to one process and waited on after another took its place fails as Ray's does (died=True).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import cluster.driver.rollout_pool as rollout_pool
from actors.runtime.waits import ActorFailed

# The driver's modules that wait on actors; use_fake_ray patches each helper where a module has it.
DRIVER_MODULES = ("cluster.driver.rollout_pool", "cluster.driver.engine_weights", "cluster.driver.worker_groups",
                  "cluster.driver.comebacks", "cluster.driver.reference", "cluster.driver.actor_restarts",
                  "cluster.driver.pipeline", "cluster.driver.trainer")


@dataclass
class Faults:
    dead: bool = False
    hung: bool = False
    state: str = "ALIVE"  # Ray's actor table: ALIVE | RESTARTING | DEAD | PENDING_CREATION
    restarts: int = 0  # how many times Ray restarted it
    comes_back_as: int | None = None


class FakeActor:
    """What every actor answers (actors/runtime/actor_base.py ActorBase): info, set_threads."""

    def __init__(self, pid: int, node_id: str | None = None):
        self.pid, self.node_id, self.threads = pid, node_id or f"node-{pid}", 0
        self.faults = Faults()
        self.calls: list[tuple] = []  # (method, args) as sent

    def set_threads(self, n: int) -> None:
        self.threads = n

    def info(self) -> dict:
        return {"pid": self.pid, "node_id": self.node_id, "hostname": f"host-{self.node_id}", **self.own_info()}

    def own_info(self) -> dict:
        return {}

    def _restarted(self) -> None:
        """What a new process of this actor lacks that the old one had (none here)."""


def die(actor: FakeActor, comes_back_as: int | None = None) -> None:
    """The actor's process dies; Ray restarts it as pid `comes_back_as` when next looked at (None: never)."""
    f = actor.faults
    f.dead, f.comes_back_as = True, comes_back_as
    f.state = "RESTARTING" if comes_back_as is not None else "DEAD"


def come_back(actor: FakeActor, pid: int) -> None:
    """Ray restarted the actor as process `pid`: what the old one held is gone (on_restart says what to redo)."""
    f = actor.faults
    f.dead, f.hung, f.state, f.comes_back_as, f.restarts = False, False, "ALIVE", None, f.restarts + 1
    actor.pid = pid
    actor._restarted()  # each fake says what its new process lacks (an engine: the weights)


class FakeRef:
    """A call sent (`method(*args, **kwargs)` to the process `pid`), run when it is first waited on."""

    def __init__(self, actor: FakeActor, method: str, args: tuple, kwargs: dict):
        self.actor, self.method, self.args, self.kwargs, self.pid = actor, method, args, kwargs, actor.pid
        self._answered, self._value = False, None

    def result(self, name: str, what: str, timeout_s: float):
        if self._answered:
            return self._value
        f = self.actor.faults
        if f.dead or self.actor.pid != self.pid:
            raise ActorFailed(name, what, died=True, detail="the actor died (fake)")
        if f.hung:
            raise ActorFailed(name, what, died=False, detail=f"no answer within {timeout_s:.0f}s (fake: hung)")
        self._value = getattr(self.actor, self.method)(*self.args, **self.kwargs)  # its own error is raised as is
        self._answered = True
        return self._value


class _Method:
    def __init__(self, actor: FakeActor, name: str):
        self.actor, self.name = actor, name

    def remote(self, *args, **kwargs) -> FakeRef:
        self.actor.calls.append((self.name, args))
        return FakeRef(self.actor, self.name, args, kwargs)

    def options(self, **_options) -> _Method:  # e.g. concurrency_group="lend"
        return self


class FakeHandle:
    """`handle.method.remote(...)` for every public method of the fake actor (AttributeError for any other, as
    Ray's handle raises for a method the class lacks)."""

    def __init__(self, actor: FakeActor):
        self.actor = actor

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_") or not callable(getattr(self.actor, name, None)):
            raise AttributeError(f"{type(self.actor).__name__} has no remote method {name!r}")
        return _Method(self.actor, name)


def handle(actor: FakeActor) -> FakeHandle:
    return FakeHandle(actor)


def wait_for(ref, actor: str, what: str, timeout_s: float, bound: str | None = None, probe=None):
    """cluster/launch/waits.py wait_for over FakeRefs (a list of them: each answer; they answer at once, so no
    waiting line is said and no probe sent)."""
    if isinstance(ref, list):
        return [r.result(actor, what, timeout_s) for r in ref]
    return ref.result(actor, what, timeout_s)


def wait_all(refs: list, actors: list[str], what: str, timeout_s: float, watch=None) -> list:
    """wait_all over FakeRefs: the first actor that dies or hangs raises, naming it."""
    return [ref.result(name, what, timeout_s) for ref, name in zip(refs, actors)]


def actor_state(h: FakeHandle) -> tuple[str, int]:
    """Ray's table: an actor being restarted is back (as its `comes_back_as` pid) once the driver looks."""
    f = h.actor.faults
    if f.state == "RESTARTING" and f.comes_back_as is not None:
        come_back(h.actor, f.comes_back_as)
    return f.state, f.restarts


def use_fake_ray(monkeypatch, modules: tuple[str, ...] = DRIVER_MODULES) -> None:
    """The driver's modules wait on FakeRefs (each helper replaced where the module imported it), and the pool's
    pauses between looks at a restarting engine take no time."""
    for name in modules:
        module = importlib.import_module(name)
        for helper in (wait_for, wait_all, actor_state):
            if hasattr(module, helper.__name__):
                monkeypatch.setattr(module, helper.__name__, helper)
    monkeypatch.setattr(rollout_pool.time, "sleep", lambda s: None)
