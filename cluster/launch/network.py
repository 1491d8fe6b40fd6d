"""Where the actors of a run are on the network: each one's host, the address it advertises to its
gloo/NCCL peers and the interface that holds it (actors/runtime/sockets.py network_view). Shown at
start on the console and kept in placement.json, so a wrong address or NIC is seen before a hang.
"""
from __future__ import annotations

from cluster.launch.waits import wait_for


def bundle_node(pg, bundle: int, live_only: bool = False) -> tuple[str, str, str]:
    """(node IP as Ray knows it, hostname, node id) of the node a ready placement group put `bundle` on.
    `live_only`: ("", "", "") when the bundle is not on a live node (not placed yet, or not again since its
    node died)."""
    import ray
    from ray.util.placement_group import placement_group_table

    node_ids = placement_group_table(pg)["bundles_to_node_id"]
    node_id = node_ids.get(bundle) if live_only else node_ids[bundle]
    nodes = (n for n in ray.nodes() if n["NodeID"] == node_id and (n["Alive"] or not live_only))
    node = next(nodes, None) if live_only else next(nodes)
    if node is None:
        return "", "", ""
    return node["NodeManagerAddress"], node.get("NodeManagerHostname") or node["NodeManagerAddress"], node_id


def bundle_nodes(pg) -> list[str]:
    """The node id of every bundle of a ready placement group."""
    from ray.util.placement_group import placement_group_table

    return list(placement_group_table(pg)["bundles_to_node_id"].values())


def add_network(handles: dict, placement: list[dict], towards: str, timeout_s: float) -> list[str]:
    """Ask every actor (`handles`: role -> handle) for its network view towards learner rank 0's
    address `towards`; add it to its placement entry; return the console lines, one per host."""
    refs = {role: h.network.remote(towards) for role, h in handles.items()}
    views = {role: wait_for(ref, role, "saying its address", timeout_s) for role, ref in refs.items()}
    hosts: dict[tuple, list[str]] = {}
    for p in placement:
        v = views.get(p["role"])
        if v is None:
            continue
        p["network"] = v
        key = (v["hostname"], v["address"], v["interface"], v["interface_from"])
        hosts.setdefault(key, []).append(p["role"])
    return [f"network: {host} advertises {address}, gloo/NCCL interface {iface} ({how}): {', '.join(roles)}"
            for (host, address, iface, how), roles in hosts.items()]
