"""FakeHosts: cluster/launch/hosts.py HostWatch without Ray's node table: the nodes named in `dead` are lost."""
from __future__ import annotations


class FakeHosts:
    def __init__(self):
        self.where: dict[str, str] = {}  # actor name -> node id
        self.dead: set[str] = set()  # node ids Ray marked dead

    def place(self, actor: str, node_id: str | None) -> None:
        if node_id:
            self.where[actor] = node_id

    def forget(self, actor: str) -> None:
        self.where.pop(actor, None)

    def host_lost(self, actor: str) -> bool:
        return self.where.get(actor) in self.dead

    def check(self) -> list[str]:
        return [a for a, node in self.where.items() if node in self.dead]

    def describe(self, actor: str) -> str:
        return f"127.0.0.1 (fake, Ray node {self.where.get(actor, '?')})"

    def room_note(self, fresh: bool = False) -> str:
        return "live nodes: 127.0.0.1 (fake, 2 CPU)"
