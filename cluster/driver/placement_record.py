"""placement.json: where each actor of the run runs, as of now.

One row per actor (its role, pid, Ray node, threads, and its `network` view: host, advertised address,
interface), read when the actors are ready, and kept true when one runs again in a new process: learner
ranks after a restart, an engine Ray restarted, one that rejoined or joined the fleet, the reference
actor or a reward model Ray moved. Each such actor is asked for its network view again, and the console
says where it is (`network: HOST advertises ADDRESS, ...`), as at start.
"""
from __future__ import annotations

import json
from pathlib import Path

from actors.runtime.atomic_file import replace_text
from cluster.launch.network import add_network
from cluster.launch.placement import Actors, actor_roles


def actor_name(placement_row: dict) -> str:
    """The name errors give the actor of a placement.json row ("rollout-1" -> "rollout worker 1")."""
    role = placement_row.get("role") or f"learner-{placement_row['rank']}"
    kind, _, index = role.partition("-")
    return {"rollout": f"rollout worker {index}", "learner": f"learner rank {index}", "reference": "reference actor",
            "reward": f"reward model {placement_row.get('model', index)}"}.get(kind, role)


class PlacementRecord:
    """The rows of placement.json (iterable, one dict per actor) and their file in the run dir."""

    def __init__(self, rows: list[dict], run_dir: Path, actors: Actors, timeout_s: float):
        """`rows`: wait_ready's answers; `actors`: the handles asked for their network views (the object is
        kept: a learner restart replaces its handles and rank 0's address in place)."""
        self.rows, self.path, self.actors, self.timeout_s = rows, Path(run_dir) / "placement.json", actors, timeout_s

    def __iter__(self):
        return iter(self.rows)

    def row(self, role: str) -> dict:
        """The row of `role`, made empty if it has none yet (an engine an elastic start had no room for)."""
        found = next((p for p in self.rows if p["role"] == role), None)
        if found is None:
            self.rows.append(found := {"role": role})
        return found

    def named(self, name: str) -> dict:
        """The row of the actor errors call `name` ("reference actor", "reward model PATH")."""
        return next(p for p in self.rows if actor_name(p) == name)

    def say_network(self, roles: list[str] | None = None) -> None:
        """Ask the actors of `roles` (all: None) for their network view, keep it in their rows, print the
        console's `network:` lines (one per host), then write placement.json."""
        handles = {role: h for role, h in actor_roles(self.actors).items() if roles is None or role in roles}
        rows = [p for p in self.rows if roles is None or p["role"] in roles]
        for line in add_network(handles, rows, self.actors.master_address, self.timeout_s):
            print(line, flush=True)
        self.write()

    def write(self) -> None:
        # whole or not at all: users' tools (and the tests) read the file while the run rewrites it
        replace_text(self.path, json.dumps(self.rows, indent=1))
