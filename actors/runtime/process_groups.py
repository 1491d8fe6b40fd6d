"""The process groups' torch side: the TCPStore that listens only on the address the peers were told, and
the gloo group bound to the interface on the route to it (sockets.py finds addresses, ports and routes).

torch only, no vLLM: a learner rank sets up its group without the rollout side's packages. Apart from
sockets.py because torch takes seconds to import and the driver's config check needs only the sockets.
"""
from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist

from actors.runtime.sockets import local_ip_towards


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening socket bound here on `host` only (port 0: the OS picks a free one), for a store's server: the
    port is bound in the process that serves it, never chosen in one process and bound in another."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(512)
    except OSError:
        sock.close()
        raise
    return sock


def listening_store(host: str, port: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """A TCPStore server listening on `host` only (the address its peers were told), port 0: a free one.

    TCPStore alone binds every interface whatever host it is given, so the listening socket is
    made here and handed over (`master_listen_fd`; the store owns it from then on).
    """
    sock = bind_listener(host, port)
    port = sock.getsockname()[1]
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
