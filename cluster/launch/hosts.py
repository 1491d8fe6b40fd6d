"""Which host each actor of a run is on, and saying so, in raygrpo's words, when a host is lost.

Ray marks a node dead when its raylet misses its heartbeats (every process of the host killed, the
machine gone, its link down). `HostWatch` keeps the node of every actor (from their info() calls),
answers "was this actor's host lost?" from Ray's node table, and says once per host which host it
was (address, hostname, Ray node id) and which of the run's actors were on it. Ray's own raw lines
for it are kept out of a quiet console by `divert_node_death_lines` (they still go to
RUN_DIR/logs/driver.log): "(raylet) The node with node id: ... has been marked dead because the
detector has missed too many heartbeats", and, when a host that was partitioned comes back, its
raylet's exit ("Exiting because this node manager has mistakenly been marked as dead by the GCS"
with a stack trace, and "Raylet is terminated ..." quoting it); raygrpo says that in one line.
"""
from __future__ import annotations

import logging
import sys

RAY_NODE_DEATH_TEXT = "has been marked dead because"
# What a partitioned host's raylet says when its link is back and it learns it was marked dead (it exits).
RAY_NODE_CAME_BACK_TEXT = "mistakenly been marked as dead"
# What Ray prints, quoting a raylet's last log lines, when that raylet died (a host lost: HostWatch says it).
RAYLET_DIED_TEXT = "Raylet is terminated"
_known_nodes: dict[str, dict] = {}  # the last node table read (the diverter names a host by its address from it)


def node_table() -> dict[str, dict]:
    """Ray's nodes, dead ones included: node id -> {"alive", "address", "hostname", "cpus"}."""
    import ray

    nodes = {n["NodeID"]: {"alive": bool(n.get("Alive")), "address": n.get("NodeManagerAddress", "?"),
                           "hostname": n.get("NodeManagerHostname", "?"), "cpus": n.get("Resources", {}).get("CPU", 0)}
             for n in ray.nodes()}
    _known_nodes.clear()
    _known_nodes.update(nodes)
    return nodes


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

    def room_note(self, fresh: bool = False) -> str:
        """The live nodes and their CPUs, for a waiting line or an error (`fresh`: Ray's node table read now,
        not the last one read: a wait for a node with room names the nodes that joined meanwhile)."""
        nodes = node_table() if fresh or not self._nodes else self._nodes
        live = [f"{n['address']} ({n['hostname']}, {n['cpus']:g} CPU)" for n in nodes.values() if n["alive"]]
        return "live nodes: " + (", ".join(live) or "none")


def describe_address(address: str) -> str:
    """A host by its address, with its hostname and Ray node id (from the last node table read, else read now)."""
    for _ in range(2):
        node = next((i for i, n in _known_nodes.items() if n["address"] == address), None)
        if node:
            return describe_node(node, _known_nodes)
        try:
            node_table()
        except Exception:  # noqa: BLE001 - only to name the host better; its address names it anyway
            break
    return address


def divert_node_death_lines() -> None:
    """Ray prints a node's death on the driver's console as "(raylet)" lines; raygrpo says it itself
    (HostWatch), so those lines go to the driver's log instead: the GCS's "marked dead" line, "Raylet is
    terminated" with the dead raylet's last log lines (a host killed), and a partitioned host's raylet
    exiting when its link is back (its lines, stack trace included); for the latter raygrpo says once which host came back
    and that Ray does not take it back. Two ways in (Ray 2.60's private names): its error-message thread
    calls `ray._private.worker.print_to_stdstream` by its module name (wrapped there), and the nodes' log
    lines go through `global_worker_stdstream_dispatcher`'s "ray_print_logs" handler, which ray.init bound
    to the original function (replaced there)."""
    from ray._private import worker

    original = worker.print_to_stdstream
    if getattr(original, "raygrpo_diverts", False):
        return
    came_back: set[str] = set()  # addresses of raylets that exited after their node was marked dead

    def keep_off(data) -> bool:
        if data.get("pid") != "raylet" or not diverted(data, came_back):
            return False
        for line in data.get("lines", []):
            logging.getLogger("ray").info("(raylet) %s", line)  # RUN_DIR/logs/driver.log when quiet
        return True

    def print_to_stdstream(data, ignore_prefix: bool):
        if not keep_off(data):
            original(data, ignore_prefix)

    print_to_stdstream.raygrpo_diverts = True
    worker.print_to_stdstream = print_to_stdstream
    dispatcher = worker.global_worker_stdstream_dispatcher
    with dispatcher._lock:
        dispatcher.handlers = [(name, _diverting(handler, keep_off) if name == "ray_print_logs" else handler)
                               for name, handler in dispatcher.handlers]


def _diverting(handler, keep_off):
    def handle(data):
        if not keep_off(data):
            handler(data)

    return handle


def diverted(data: dict, came_back: set[str]) -> bool:
    """Whether a "(raylet)" batch of lines is about a node's death (see divert_node_death_lines); says a
    host that came back after it was marked dead, once. `came_back`: the addresses already said (every
    later line of their raylet is its exit's too)."""
    text = "\n".join(str(line) for line in data.get("lines", []))
    ip = data.get("ip")
    if ip and ip in came_back:
        return True
    if RAY_NODE_CAME_BACK_TEXT in text:
        if ip:
            came_back.add(ip)
            print(f"host {describe_address(ip)} is reachable again, but Ray had marked it dead: its raylet exited "
                  "(Ray does not take a dead node back); the run goes on without it, and `ray start --address=...` "
                  "on that host joins it again as a new node", flush=True)
        return True
    return RAY_NODE_DEATH_TEXT in text or RAYLET_DIED_TEXT in text


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
