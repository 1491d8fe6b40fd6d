"""ActorBase: what every actor of a run answers, whatever it computes.

The driver asks each actor (a rollout engine, a learner rank, the reference, a reward model)
the same three things: `info()` (which process, on which node, with how many cores and torch
threads: placement.json, the restart checks), `network(towards)` (the host and the address and
interface it shows its peers) and `set_threads(n)` (the driver's thread budget,
cluster/launch/thread_budget.py). They are answered here once; an actor adds its own fields to
`info()` with `own_info()`.

A plain class, like the actors that inherit it: the driver wraps each with `ray.remote`, and Ray
finds an actor's remote methods on its class (inherited ones included).
"""
from __future__ import annotations

import os
import socket

import torch

from actors.runtime.sockets import network_view
from actors.runtime.threads import node_cores, use_threads


class ActorBase:
    """info, network and threads of one actor process. `threads` is the torch thread count the
    actor computes with (0: leave torch's own); the subclass sets it before its first computation."""

    threads: int = 0
    # GLOO_SOCKET_IFNAME as the process got it, where the actor sets it itself later (a learner rank
    # sets it from the route when it joins its group); None: read it from the environment when asked.
    pinned_ifname: str | None = None

    def set_threads(self, n: int) -> None:
        """The torch threads this actor computes with from now on (the driver's thread budget)."""
        self.threads = n
        use_threads(n)

    def network(self, towards: str) -> dict:
        """This actor's host, advertised address and gloo interface (placement.json, the console)."""
        return network_view(towards, self.pinned_ifname)

    def info(self) -> dict:
        """Which process this is and where it runs, then what the actor adds (`own_info`)."""
        return {"pid": os.getpid(), "node_id": ray_node_id(), "hostname": socket.gethostname(),
                "cores": node_cores(), "torch_threads": torch.get_num_threads(), **self.own_info()}

    def own_info(self) -> dict:
        """The fields of `info()` that only this kind of actor has."""
        return {}


def ray_node_id() -> str | None:
    """The Ray node this process runs on; None outside Ray (a plain process in a test, the bench)."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - info must answer even where Ray is half there
        return None
