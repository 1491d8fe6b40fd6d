"""Sockets for the process groups: the learner ranks' rendezvous (learner/rank_setup.py) and the
gloo weight transfer (actors/transport/gloo_trainer.py) both listen only on the address their peers were
told, and bind gloo to the interface on the route to it (process_groups.py builds the groups on them).

No torch, no vLLM: the driver's config check reads this module and stays quick.
"""
from __future__ import annotations

import contextlib
import errno
import os
import random
import socket
import time
from pathlib import Path

import psutil


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the OS picks it; another process may take it before it is used: never hand
    it to another process to bind, PortBoard is the way)."""
    return free_ports(1, host)[0]


# Ports a test or tool hands to another process to bind (a Ray head's command line, a SLURM config) come from
# here: above Ray's worker ports (10002-19999 by default) and below the kernel's ephemeral range, from which every
# bind(0) and outgoing connection on the machine takes its port. From inside that range, a gloo store's or an
# engine's bind(0) could take the port between the pick and the other process's bind.
HANDED_OUT_PORTS_FROM = 20_000


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n TCP ports free on `host` now and different from each other: each is held while the next is picked (n
    free_port() calls, each closed at once, can return one port twice: Ray then refused to start, "dashboard_agent_grpc
    is trying to use a port number 53379 that is used by other components", 2026-11-29). For ports given on a
    command line (a hand-started Ray head, a SLURM config), with free_port's caveat; drawn at random below the
    ephemeral range (HANDED_OUT_PORTS_FROM), where nothing else on the machine picks a port by itself, else the
    OS's pick."""
    below = range(HANDED_OUT_PORTS_FROM, _ephemeral_start())
    # a generator of its own, seeded by the OS: processes that seeded `random` alike (the tests do) draw apart
    draws = random.SystemRandom().sample(below, min(len(below), 64 * n))
    return bind_first_free(draws + [0] * n, n, host)


def bind_first_free(candidates: list[int], n: int, host: str = "127.0.0.1") -> list[int]:
    """The first n of `candidates` that `host` can bind now (0: the OS's pick), each held while the next is tried;
    one in use (or in TIME_WAIT) is passed over."""
    with contextlib.ExitStack() as held:
        socks = []
        for port in candidates:
            s = socket.socket()
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            socks.append(held.enter_context(s))
            if len(socks) == n:
                break
        return [s.getsockname()[1] for s in socks]


class PortBoard:
    """Where learner rank 0 posts the rendezvous port it bound (port 0: the OS's pick, in its own process) and
    the other ranks read it: no port is chosen in one process and bound in another, where anything on the node
    could take it in between ("Address already in use" at a run's start, issue 59). Ray's key-value store (in
    its GCS, which every process of the run reaches) holds it; `kv`: a dict-like stand-in for tests."""

    NAMESPACE = "raygrpo"

    def __init__(self, kv=None):
        self.kv = kv

    def publish(self, key: str, port: int) -> None:
        if self.kv is not None:
            self.kv[key] = port
            return
        from ray.experimental.internal_kv import _internal_kv_put

        _internal_kv_put(key, str(port), overwrite=True, namespace=self.NAMESPACE)

    def read(self, key: str) -> int | None:
        if self.kv is not None:
            return self.kv.get(key)
        from ray.experimental.internal_kv import _internal_kv_get

        value = _internal_kv_get(key, namespace=self.NAMESPACE)
        return int(value) if value else None

    def wait(self, key: str, timeout_s: float, who: str) -> int:
        """The port posted under `key`, polled every 0.1 s for at most `timeout_s`; then a TimeoutError naming
        `who` waited for it."""
        deadline = time.monotonic() + timeout_s
        while (port := self.read(key)) is None:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{who} waited {timeout_s:.0f}s for learner rank 0 to post the port of its "
                                   f"rendezvous ({key!r} in Ray's key-value store): rank 0 did not start; its log "
                                   "says why")
            time.sleep(0.1)
        return port


def local_ip_towards(address: str) -> str:
    """This machine's IP on the route to `address` (no packet is sent: UDP connect only picks
    the interface). Gloo advertises it to its peers, so it must be reachable from them."""
    if address in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((address, 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def interface_of(ip: str) -> str | None:
    """The name of the network interface that holds `ip` (gloo binds by interface name)."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addrs):
            return name
    return None


def address_of(interface: str) -> str | None:
    """The IPv4 address of `interface` (what gloo advertises when it is pinned to it)."""
    for a in psutil.net_if_addrs().get(interface, []):
        if a.family == socket.AF_INET:
            return a.address
    return None


def network_view(towards: str, pinned: str | None = None) -> dict:
    """What this process shows its peers: its host, the address it advertises to gloo on the way to
    `towards` (learner rank 0's address) and the interface that holds it, pinned or by the route.
    `pinned`: GLOO_SOCKET_IFNAME as the process got it (a learner rank sets it itself from the route)."""
    pinned = os.environ.get("GLOO_SOCKET_IFNAME", "") if pinned is None else pinned
    address = (address_of(pinned) if pinned else None) or local_ip_towards(towards)
    view = {"hostname": socket.gethostname(), "address": address,
            "interface": pinned or interface_of(address) or "?",
            "interface_from": "pinned by GLOO_SOCKET_IFNAME" if pinned else f"on the route to {towards}"}
    if os.environ.get("NCCL_SOCKET_IFNAME"):
        view["nccl_interface"] = os.environ["NCCL_SOCKET_IFNAME"]
    return view


class PeerUnreachable(ConnectionError):
    """A process could not reach the address a peer advertised within its bounded wait."""


# A refused connection means the host answered (its listener is not up yet): reachable. What is not
# reachable never answers (a timeout: a firewall dropping, a wrong network) or has no route.
_UNREACHABLE = (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT, errno.EHOSTDOWN)


def reach(address: str, port: int, timeout_s: float, me: str, peer: str) -> None:
    """Return once a TCP connection to `address:port` is accepted or refused (the host answers);
    after `timeout_s` without an answer, a PeerUnreachable naming this host, the peer's host and
    the address. `me`: who is connecting ("learner rank 1"); `peer`: whom ("learner rank 0 on host-a")."""
    deadline, last = time.monotonic() + timeout_s, "no answer"
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((address, port), timeout=max(0.5, min(5.0, left))):
                return
        except ConnectionRefusedError:
            return
        except OSError as e:
            if e.errno is not None and e.errno not in _UNREACHABLE:
                return  # anything else is not about reaching the host: the store's own connect reports it
            last = "timed out" if isinstance(e, TimeoutError) or e.errno == errno.ETIMEDOUT else (e.strerror or str(e))
        if time.monotonic() >= deadline:
            here = f"{socket.gethostname()} ({local_ip_towards(address)})"
            raise PeerUnreachable(
                f"{me} on {here} could not reach {peer} at the address it advertises, {address}:{port}, within "
                f"{timeout_s:.0f}s ({last}). {address} must be reachable from {socket.gethostname()}: check the "
                f"firewall between the nodes (README, Multi-node), and that the address is the node's own on the "
                f"network the nodes share (`ray start --node-ip-address`; ray.network_interface pins gloo's and "
                f"NCCL's interface)")
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
