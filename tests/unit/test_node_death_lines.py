"""Ray's raw lines about a node's death stay off the console (cluster/launch/hosts.py `diverted`): the GCS's
"marked dead" line, and a partitioned host's raylet exiting when its link is back, which raygrpo says once in
its own words. The lines are those Ray 2.60 printed in tests/e2e/test_multinode.py's partition."""
from __future__ import annotations

from cluster.launch import hosts

EXIT = ("[2026-11-26 08:39:32,825 C 15445 15445] (raylet) node_manager.cc:971: [Timeout] Exiting because this node "
        "manager has mistakenly been marked as dead by the GCS: GCS failed to check the health of this node for 5 times.")
TRACE = "/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet(+0x23ccf4) [0x558e87ccacf4] main"


def test_a_raylet_that_came_back_after_it_was_marked_dead_is_said_once_and_its_lines_diverted(capsys, monkeypatch):
    monkeypatch.setattr(hosts, "_known_nodes", {"3cc374a0dfe9": {"alive": False, "address": "10.77.1.2",
                                                                 "hostname": "host-b", "cpus": 1}})
    said: set[str] = set()
    assert hosts.diverted({"pid": "raylet", "ip": "10.77.1.2", "lines": [EXIT, "*** StackTrace Information ***"]}, said)
    assert hosts.diverted({"pid": "raylet", "ip": "10.77.1.2", "lines": [TRACE]}, said)  # the rest of its trace
    # its watchdog's report quotes the raylet's last lines, with no ip
    assert hosts.diverted({"pid": "raylet", "lines": [f"Raylet is terminated. Termination is unexpected. ...\n    {EXIT}"]},
                          said)
    out = capsys.readouterr().out
    assert out.count("is reachable again") == 1
    assert ("host 10.77.1.2 (host-b, Ray node 3cc374a0) is reachable again, but Ray had marked it dead: its raylet "
            "exited (Ray does not take a dead node back)") in out


def test_the_marked_dead_line_is_diverted_and_other_raylet_lines_are_not(capsys):
    said: set[str] = set()
    assert hosts.diverted({"pid": "raylet", "lines": ["The node with node id: 0250bf and address: 10.77.1.2 and "
                                                      "node name: 10.77.1.2 has been marked dead because the detector "
                                                      "has missed too many heartbeats from it."]}, said)
    assert not hosts.diverted({"pid": "raylet", "ip": "10.77.1.1", "lines": ["Task killed due to the node running "
                                                                             "low on memory."]}, said)
    assert capsys.readouterr().out == ""
