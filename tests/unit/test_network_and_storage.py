"""Multi-node set-up, the parts that need no cluster: the interface env reaching the actors, the
bounded wait on an unreachable peer, what a node reports on the shared-storage check."""
from __future__ import annotations

import os
import socket
import time

import pytest

from actors.runtime import sockets
from actors.runtime.sockets import PeerUnreachable, free_ports, network_view, reach
from cluster.bench.cross_host import table_rows, two_nodes
from cluster.bench.report import resolve_setting
from cluster.config import ConfigError, load_config
from cluster.launch.ray_cluster import SOCKET_IFNAME_VARS, pin_network_interface, worker_runtime_env
from cluster.launch.shared_storage import look


@pytest.fixture
def clean_ifname_env(monkeypatch):
    """The interface variables unset for the test and restored after it, including those that
    pin_network_interface sets (delenv of an unset variable records nothing to restore: setenv first)."""
    for k in SOCKET_IFNAME_VARS:
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    return monkeypatch


def test_the_drivers_interface_variables_reach_every_actor_and_the_config_key_sets_both(clean_ifname_env):
    assert not set(SOCKET_IFNAME_VARS) & set(worker_runtime_env()["env_vars"])  # unset: nothing invented
    clean_ifname_env.setenv("NCCL_SOCKET_IFNAME", "^docker,lo")
    assert worker_runtime_env()["env_vars"]["NCCL_SOCKET_IFNAME"] == "^docker,lo"
    assert "GLOO_SOCKET_IFNAME" not in worker_runtime_env()["env_vars"]
    pin_network_interface("")  # the key unset: the driver's own stay
    assert os.environ["NCCL_SOCKET_IFNAME"] == "^docker,lo"
    pin_network_interface("eth7")
    env = worker_runtime_env()["env_vars"]
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "eth7"


def test_the_interface_variables_do_not_outlive_the_test_above():
    """A leaked GLOO_SOCKET_IFNAME=eth7 made every later gloo test of the same session fail."""
    assert os.environ.get("GLOO_SOCKET_IFNAME") != "eth7" and os.environ.get("NCCL_SOCKET_IFNAME") != "eth7"


def test_network_interface_and_connect_timeout_are_checked():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["ray.network_interface=eth 0", "ray.connect_timeout_s=0"], validate_paths=False)
    text = "\n".join(e.value.problems)
    assert "ray.network_interface must be one network interface's name" in text
    assert "ray.connect_timeout_s must be > 0" in text


@pytest.mark.parametrize("name", ["eth0:1;rm", "eth0;rm -rf /", "$(id)", "a" * 16, "eth0,eth1"])
def test_a_network_interface_that_is_no_interface_name_is_refused_by_key(name):
    """Issue 59, item 8: 'eth0:1;rm' passed the config check and failed 32 s later in gloo's C++ ("Unable to find
    address"), which does not name the key."""
    with pytest.raises(ConfigError, match=r"ray.network_interface must be one network interface's name"):
        load_config(None, [f"ray.network_interface={name!r}"], validate_paths=False)


@pytest.mark.parametrize("name", ["eth0", "eth0:1", "enp0s31f6", "br-1a2b.100", "lo"])
def test_interface_names_linux_gives_pass_the_config_check(name):
    assert load_config(None, [f"ray.network_interface={name}"], validate_paths=False).ray.network_interface == name


def test_an_embedded_cluster_refuses_an_interface_this_host_lacks_naming_those_it_has(clean_ifname_env):
    with pytest.raises(ValueError, match=r"ray.network_interface='nosuch0': this host has no such network interface "
                                         r"\(it has .*lo"):
        pin_network_interface("nosuch0", embedded=True)
    assert "GLOO_SOCKET_IFNAME" not in os.environ  # nothing pinned
    pin_network_interface("lo", embedded=True)
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    pin_network_interface("nosuch0", embedded=False)  # a joined cluster: its nodes' interfaces are not this host's
    assert os.environ["GLOO_SOCKET_IFNAME"] == "nosuch0"


def test_network_view_names_the_host_the_address_and_the_interface(clean_ifname_env):
    v = network_view("127.0.0.1")
    assert v == {"hostname": socket.gethostname(), "address": "127.0.0.1", "interface": "lo",
                 "interface_from": "on the route to 127.0.0.1"}
    clean_ifname_env.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert network_view("127.0.0.1")["interface_from"] == "pinned by GLOO_SOCKET_IFNAME"


def test_a_listener_not_up_yet_counts_as_reachable():
    with socket.socket() as s:  # a port nobody listens on: refused at once, i.e. the host answered
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t = time.monotonic()
    reach("127.0.0.1", port, 5, "learner rank 1", "learner rank 0's rendezvous on host-a")
    assert time.monotonic() - t < 2


def test_an_address_that_never_answers_fails_within_the_bound_naming_both_hosts(monkeypatch):
    # No address is unreachable on every machine (this one's gateway is TEST-NET-1's .1): the network
    # drops every SYN here, as a firewall does
    tries = []

    def dropped(address, timeout):
        tries.append(address)
        time.sleep(timeout)
        raise TimeoutError("timed out")

    monkeypatch.setattr(socket, "create_connection", dropped)
    t = time.monotonic()
    with pytest.raises(PeerUnreachable) as e:
        reach("192.0.2.1", 29500, 3, "learner rank 1", "learner rank 0's rendezvous on host-a")
    assert len(tries) >= 1 and tries[0] == ("192.0.2.1", 29500)
    assert 3 <= time.monotonic() - t < 8
    msg = str(e.value)
    assert f"learner rank 1 on {socket.gethostname()} (" in msg
    assert "could not reach learner rank 0's rendezvous on host-a at the address it advertises, 192.0.2.1:29500" \
        in msg and "within 3s" in msg


def test_a_node_reports_the_paths_it_does_not_share(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (tmp_path / "nonce").write_text("abc")
    assert look([str(model)], str(tmp_path / "nonce"), "abc") == {"hostname": socket.gethostname(), "models": {},
                                                           "nonce": "abc"}
    empty = tmp_path / "empty"
    empty.mkdir()
    t = time.monotonic()
    got = look([str(tmp_path / "missing"), str(empty)], str(tmp_path / "run" / "nonce"), "abc", patience_s=1.5)
    assert time.monotonic() - t >= 1.5  # it looked again before saying so
    assert got["models"] == {str(tmp_path / "missing"): "does not exist there",
                             str(empty): "holds no config.json there (another directory at the same path?)"}
    assert got["nonce"] is None


def test_the_crosshost_bench_part_runs_only_when_named_and_says_it_needs_two_nodes():
    assert "crosshost" not in resolve_setting("default").parts  # a plain `raygrpo bench` needs one node only
    assert resolve_setting("default", parts="crosshost").parts == ("crosshost",)

    class OneNode:  # what ray answers on a one-node cluster
        @staticmethod
        def get_runtime_context():
            return type("Ctx", (), {"get_node_id": staticmethod(lambda: "n1")})()

        @staticmethod
        def nodes():
            return [{"NodeID": "n1", "Alive": True, "NodeManagerAddress": "10.0.0.1"}]

    with pytest.raises(RuntimeError, match=r"needs a Ray cluster of two nodes or more .*this cluster has one \(10.0.0.1\)"):
        two_nodes(OneNode)


def test_the_crosshost_ratio_says_when_both_hosts_share_one_kernel():
    """Namespaces on one machine share its cores: the ratio's note says so, so nobody reads it as a link's figure."""
    result = {"host_a": "host-a", "host_b": "host-b", "sync": {"seconds": 0.07, "bytes": 50 << 20, "transport": "gloo"},
              "raw_broadcast": {"seconds": 0.035}, "vs_raw": 2.0, "cpus": [2, 2]}
    shared = table_rows({"cross_host": {**result, "one_machine": True}})[-1]
    assert shared == ("crosshost", "full update / raw broadcast", 2.0, "goal <= 1.4; both hosts on one kernel, 2 cores shared")
    assert table_rows({"cross_host": {**result, "one_machine": False}})[-1][-1] == "goal <= 1.4"
    assert table_rows({}) == []


def test_free_ports_are_distinct_and_free_when_returned():
    """Ports given on a command line (a hand-started Ray head, a SLURM config) picked together: never one port
    twice (one free_port() after another can return the same port: Ray refused to start on it)."""
    ports = free_ports(16)
    assert len(set(ports)) == 16
    for port in ports:  # each still bindable: none was left held
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_free_ports_come_from_below_the_ephemeral_range_and_pass_over_one_in_use():
    """Drawn where no bind(0) or outgoing connection on the machine picks a port by itself; a port in use there is
    passed over (tried first here, so that it is met)."""
    ports = free_ports(8)
    assert all(sockets.HANDED_OUT_PORTS_FROM <= p < sockets._ephemeral_start() for p in ports)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports[0]))
        taken.listen()
        assert sockets.bind_first_free(ports, 3) == ports[1:4]
