"""Sockets for the process groups: the learner ranks' rendezvous (learner/rank_setup.py) and the
gloo weight transfer (actors/transport/gloo_trainer.py) both listen only on the address their peers were
told, and bind gloo to the interface on the route to it (`new_gloo_group`: the transfer's group).

torch only, no vLLM: a learner rank sets up its group without the rollout side's packages.
"""
from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the OS picks it; another process may take it before it is used)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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


def listening_store(host: str, port: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """A TCPStore server listening on `host` only (the address its peers were told), port 0: a free one.

    TCPStore alone binds every interface whatever host it is given, so the listening socket is
    made here and handed over (`master_listen_fd`; the store owns it from then on).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(512)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout,
                         master_listen_fd=sock.detach())


def new_gloo_group(store, rank: int, world_size: int, master_address: str, timeout_s: float):
    """A ProcessGroupGloo over `store` (blocks until all `world_size` ranks joined)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        opts._devices = [dist.ProcessGroupGloo.create_device(interface=os.environ["GLOO_SOCKET_IFNAME"])]
    else:
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_ip_towards(master_address))]
    return dist.ProcessGroupGloo(store, rank, world_size, opts)
