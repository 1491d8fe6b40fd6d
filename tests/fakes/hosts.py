"""FakeHosts: cluster/launch/hosts.py HostWatch without Ray's node table: the nodes named in `dead` are lost.
Where each actor is (`place`, `forget`) is HostWatch's own bookkeeping; only what reads Ray's table is faked."""
from __future__ import annotations

from cluster.launch.hosts import HostWatch


class FakeHosts(HostWatch):
    def __init__(self):
        super().__init__()
        self.dead: set[str] = set()  # node ids Ray marked dead

    def host_lost(self, actor: str) -> bool:
        return self.where.get(actor) in self.dead

    def check(self) -> list[str]:
        return [a for a, node in self.where.items() if node in self.dead]

    def describe(self, actor: str) -> str:
        return f"127.0.0.1 (fake, Ray node {self.where.get(actor, '?')})"

    def room_note(self, fresh: bool = False) -> str:
        return "live nodes: 127.0.0.1 (fake, 2 CPU)"
