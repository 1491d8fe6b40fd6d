"""Ray's raw lines about a node's death stay off the console (cluster/launch/hosts.py `diverted`): the GCS's
"marked dead" line, and a partitioned host's raylet exiting when its link is back, which raygrpo says once in
its own words. The lines are those Ray 2.60 printed in tests/e2e/test_multinode.py's partition."""
from __future__ import annotations

import sys
import threading
import types

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


def test_the_marked_dead_and_raylet_terminated_lines_are_diverted_and_other_raylet_lines_are_not(capsys):
    said: set[str] = set()
    assert hosts.diverted({"pid": "raylet", "lines": ["The node with node id: 0250bf and address: 10.77.1.2 and "
                                                      "node name: 10.77.1.2 has been marked dead because the detector "
                                                      "has missed too many heartbeats from it."]}, said)
    # a host killed (tests/e2e/test_lost_host.py): Ray quotes its raylet's last lines; HostWatch says the loss
    assert hosts.diverted({"pid": "raylet", "lines": [
        "Raylet is terminated. Termination is unexpected. Possible reasons include: (1) SIGKILL by the user or system "
        "OOM killer, (2) Invalid memory access from Raylet causing SIGSEGV or SIGBUS, (3) Other termination signals. "
        "Last 20 lines of the Raylet logs:", "    [state-dump] "]}, said)
    assert not hosts.diverted({"pid": "raylet", "ip": "10.77.1.1", "lines": ["Task killed due to the node running "
                                                                             "low on memory."]}, said)
    assert capsys.readouterr().out == ""


def test_both_of_rays_ways_to_the_console_are_diverted(monkeypatch, capsys):
    """The error-message thread calls worker.print_to_stdstream by name; the nodes' log lines go through the
    dispatcher's "ray_print_logs" handler, bound by ray.init to the original function (Ray faked here)."""
    printed = []
    worker = types.ModuleType("ray._private.worker")
    worker.print_to_stdstream = lambda data, ignore_prefix: printed.append(("error thread", data["lines"][0]))
    worker.global_worker_stdstream_dispatcher = types.SimpleNamespace(
        _lock=threading.Lock(), handlers=[("ray_print_logs", lambda data: printed.append(("logs", data["lines"][0])))])
    private = types.ModuleType("ray._private")
    private.worker = worker
    monkeypatch.setitem(sys.modules, "ray", types.ModuleType("ray"))
    monkeypatch.setitem(sys.modules, "ray._private", private)
    monkeypatch.setitem(sys.modules, "ray._private.worker", worker)
    hosts.divert_node_death_lines()
    hosts.divert_node_death_lines()  # once is enough: a second call wraps nothing again
    emit = worker.global_worker_stdstream_dispatcher.handlers[0][1]
    emit({"pid": "raylet", "ip": "10.77.1.2", "lines": [EXIT]})
    emit({"pid": "raylet", "ip": "10.77.1.2", "lines": [TRACE]})
    emit({"pid": 123, "ip": "10.77.1.1", "lines": ["an engine's own line"]})
    worker.print_to_stdstream({"pid": "raylet", "lines": [f"Raylet is terminated. ... {EXIT}"]}, False)
    worker.print_to_stdstream({"pid": "raylet", "lines": ["another raylet message"]}, False)
    assert printed == [("logs", "an engine's own line"), ("error thread", "another raylet message")]
    assert capsys.readouterr().out.count("is reachable again") == 1
