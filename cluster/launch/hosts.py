"""Which host each actor of a run is on, and saying so, in raygrpo's words, when a host is lost.

Ray marks a node dead when its raylet misses its heartbeats (every process of the host killed, the
machine gone, its link down). `HostWatch` keeps the node of every actor (from their info() calls),
answers "was this actor's host lost?" from Ray's node table, and says once per host which host it
was (address, hostname, Ray node id) and which of the run's actors were on it. Ray's own raw line
for it ("(raylet) The node with node id: ... has been marked dead because the detector has missed
too many heartbeats") is kept out of a quiet console by `divert_node_death_lines` (it still goes to
RUN_DIR/logs/driver.log).
"""
from __future__ import annotations

import logging
import sys

RAY_NODE_DEATH_TEXT = "has been marked dead because"


def node_table() -> dict[str, dict]:
    """Ray's nodes, dead ones included: node id -> {"alive", "address", "hostname", "cpus"}."""
    import ray

    return {n["NodeID"]: {"alive": bool(n.get("Alive")), "address": n.get("NodeManagerAddress", "?"),
                          "hostname": n.get("NodeManagerHostname", "?"), "cpus": n.get("Resources", {}).get("CPU", 0)}
            for n in ray.nodes()}


def describe_node(node_id: str, nodes: dict[str, dict]) -> str:
    n = nodes.get(node_id, {})
    return f"{n.get('address', '?')} ({n.get('hostname', '?')}, Ray node {node_id[:8]})"


class HostWatch:
    """The node of each actor of the run, and which hosts were lost (each said once)."""

    def __init__(self):
        self.where: dict[str, str] = {}  # actor name (as errors name it) -> Ray node id
        self.said: set[str] = set()  # node ids already said lost
        self._nodes: dict[str, dict] = {}

    def place(self, actor: str, node_id: str | None) -> None:
        if node_id:
            self.where[actor] = node_id

    def forget(self, actor: str) -> None:
        self.where.pop(actor, None)

    def host_lost(self, actor: str) -> bool:
        """Whether `actor`'s host is dead in Ray's node table (said once per host when it is)."""
        node = self.where.get(actor)
        if node is None:
            return False
        self._nodes = node_table()
        if self._nodes.get(node, {}).get("alive", True):
            return False
        self._say(node)
        return True

    def check(self) -> list[str]:
        """Every actor whose host is dead now (each lost host said once)."""
        self._nodes = node_table()
        dead = {node for node in self.where.values() if not self._nodes.get(node, {}).get("alive", True)}
        for node in dead:
            self._say(node)
        return [a for a, node in self.where.items() if node in dead]

    def _say(self, node: str) -> None:
        if node in self.said:
            return
        self.said.add(node)
        held = [a for a, n in self.where.items() if n == node]
        print(f"lost host {describe_node(node, self._nodes)}: Ray marked it dead (no heartbeat from it); "
              f"it held {', '.join(held) or 'no actor of this run'}", flush=True)

    def describe(self, actor: str) -> str:
        """The host `actor` is on: address (hostname, Ray node id)."""
        node = self.where.get(actor)
        return describe_node(node, node_table()) if node else "an unknown host"

    def room_note(self) -> str:
        """The live nodes and their CPUs, for a waiting line or an error."""
        nodes = self._nodes or node_table()
        live = [f"{n['address']} ({n['hostname']}, {n['cpus']:g} CPU)" for n in nodes.values() if n["alive"]]
        return "live nodes: " + (", ".join(live) or "none")


def divert_node_death_lines() -> None:
    """Ray prints a node's death on the driver's console as a "(raylet)" line; when raygrpo says it
    itself (HostWatch) that line goes to the driver's log instead. Ray's error-message thread calls
    `ray._private.worker.print_to_stdstream` by its module name, so wrapping it there is enough."""
    from ray._private import worker

    original = worker.print_to_stdstream
    if getattr(original, "raygrpo_diverts", False):
        return

    def print_to_stdstream(data, ignore_prefix: bool):
        if data.get("pid") == "raylet" and any(RAY_NODE_DEATH_TEXT in str(line) for line in data.get("lines", [])):
            for line in data["lines"]:
                logging.getLogger("ray").info("(raylet) %s", line)  # RUN_DIR/logs/driver.log when quiet
            return
        original(data, ignore_prefix)

    print_to_stdstream.raygrpo_diverts = True
    worker.print_to_stdstream = print_to_stdstream


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
