"""Issue 59, item 13: the embedded default cluster (one machine) listens on 127.0.0.1 only, and Ray's token file is
0600. Ray is faked at ray.init here; tests/e2e/test_embedded_listeners.py checks a started cluster's sockets."""
from __future__ import annotations

import os
import stat

import pytest

from cluster.launch import auth, ray_cluster

ray = pytest.importorskip("ray")  # (not a module-level import: the project bans ray's, TID253)
ray_constants = pytest.importorskip("ray._private.ray_constants")
services = pytest.importorskip("ray._private.services")


@pytest.fixture
def fake_init(monkeypatch):
    """ray.init faked: what Ray would see at that moment (the node IP it would take, the variable its nodes get)."""
    seen = []

    def init(**kwargs):
        seen.append({"node_ip": services.get_node_ip_address(), "env": os.environ.get(ray_cluster.LOOPBACK_ONLY_ENV[0]),
                     **kwargs})

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv(ray_cluster.LOOPBACK_ONLY_ENV[0], raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray_cluster, "record_start", lambda *a, **k: None)
    monkeypatch.setattr(ray_cluster, "keep_token_private", lambda: seen.append("token checked"))
    for k in ray_cluster.NODE_START_ENV:
        monkeypatch.setenv(k, os.environ.get(k, ""))  # start_ray sets them: restored after the test
    return seen


def test_the_embedded_cluster_starts_with_the_loopback_as_its_node_ip_and_restores_rays_setting(fake_init):
    assert ray_constants.ENABLE_RAY_CLUSTER  # Linux: Ray's default is the machine's reachable IP
    ray_cluster.start_ray("", 8)
    init, token = fake_init
    assert init["address"] == "local" and init["node_ip"] == "127.0.0.1" and init["env"] == "0"
    assert token == "token checked"
    assert ray_constants.ENABLE_RAY_CLUSTER and ray_cluster.LOOPBACK_ONLY_ENV[0] not in os.environ


def test_a_joined_cluster_is_left_as_its_nodes_were_started(fake_init, monkeypatch):
    monkeypatch.setattr(ray_cluster, "resolve_gcs_address", lambda a: "10.0.0.5:6379")
    monkeypatch.setattr(ray_cluster, "gcs_auth_mode", lambda gcs: "disabled")
    monkeypatch.setattr(ray_cluster, "use_cluster_auth_mode", lambda mode, gcs: None)
    ray_cluster.start_ray("10.0.0.5:6379", 0)
    init, _ = fake_init
    assert init["address"] == "10.0.0.5:6379" and init["node_ip"] != "127.0.0.1" and init["env"] is None


def test_a_users_own_setting_of_rays_variable_wins(fake_init, monkeypatch):
    monkeypatch.setenv(ray_cluster.LOOPBACK_ONLY_ENV[0], "1")
    ray_cluster.start_ray("", 8)
    assert fake_init[0]["env"] == "1" and fake_init[0]["node_ip"] != "127.0.0.1"


def test_a_token_file_others_can_read_is_made_0600(tmp_path, monkeypatch):
    """Ray's ray.init writes ~/.ray/auth_token with the umask's mode: 0644 was seen."""
    token = tmp_path / "auth_token"
    token.write_text("x" * 64)
    token.chmod(0o644)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    said = []
    assert auth.keep_token_private(say=lambda *a, **k: said.append(a[0])) == str(token)
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and "now 0600" in said[0]
    assert auth.keep_token_private(say=said.append) is None and len(said) == 1  # already private: nothing said
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "none"))
    assert auth.keep_token_private(say=said.append) is None
