"""A learner rank's torch.distributed world (learner/rank_setup.py), in this process: gloo on loopback."""
from __future__ import annotations

import socket

import torch.distributed as dist

from learner.rank_setup import init_process_group


def test_a_lone_rank_starts_even_when_the_port_the_driver_picked_was_taken_since(monkeypatch):
    """No peer needs a lone rank's rendezvous port: it listens on any free one. Bound to the driver's pick, a
    port another process took in between failed the learner's start ("Address already in use") and cost every
    actor a restart (seen in an e2e run)."""
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)  # init_process_group sets it for the rank's process
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        init_process_group(False, "127.0.0.1", taken.getsockname()[1], rank=0, world_size=1)
        assert dist.is_initialized() and dist.get_world_size() == 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        taken.close()
