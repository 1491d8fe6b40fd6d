"""Finding the Ray token as Ray does, and the errors a user meets without one (cluster/launch/auth.py),
and the submitted job's dependency check (cluster/job_entry.py). The dashboard is faked here; the
real head is in tests/e2e/test_external_cluster.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from cluster.launch import auth

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_ray_env(monkeypatch, tmp_path):
    for k in list(os.environ):
        if k.startswith("RAY_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("HOME", str(tmp_path))
    yield tmp_path
    # use_cluster_auth_mode makes Ray re-read RAY_AUTH_MODE into its process-wide config: put the
    # environment back, then have Ray read it again, or every later Ray client in this pytest process
    # (the e2e tests' embedded cluster) would stay in the mode a test chose.
    monkeypatch.undo()
    if "ray._raylet" in sys.modules:
        from ray._raylet import Config

        Config.initialize("")


def test_token_is_found_where_ray_keeps_it_in_rays_order(no_ray_env, monkeypatch):
    home = no_ray_env
    assert auth.token_source() is None
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text("t")
    assert auth.token_source() == str(home / ".ray" / "auth_token")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(home / "missing"))
    with pytest.raises(auth.ClusterAuthError, match="RAY_AUTH_TOKEN_PATH"):
        auth.token_source()
    monkeypatch.setenv("RAY_AUTH_TOKEN", "abc")
    assert auth.token_source() == "RAY_AUTH_TOKEN"


def test_mode_follows_the_cluster_and_an_explicit_choice_wins(no_ray_env, monkeypatch):
    home = no_ray_env
    with pytest.raises(auth.ClusterAuthError, match=r"~/.ray/auth_token.*RAY_AUTH_TOKEN"):
        auth.use_cluster_auth_mode("token", "http://head:8265")
    auth.use_cluster_auth_mode("disabled", "x")
    assert os.environ["RAY_AUTH_MODE"] == "disabled"  # never send a token to a cluster without tokens
    monkeypatch.delenv("RAY_AUTH_MODE")
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text("t")
    auth.use_cluster_auth_mode(None, "x")  # the cluster could not be asked: a token at hand means token mode
    assert os.environ["RAY_AUTH_MODE"] == "token"
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    auth.use_cluster_auth_mode("token", "x")
    assert os.environ["RAY_AUTH_MODE"] == "disabled"


class _TokenDashboard(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        body = json.dumps({"authentication_mode": "token"}).encode()
        self.send_response(200 if self.path == "/api/authentication_mode" else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_submit_without_a_token_to_a_token_cluster_is_a_clear_error(no_ray_env):
    server = HTTPServer(("127.0.0.1", 0), _TokenDashboard)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = subprocess.run(
            [sys.executable, "-m", "cluster.cli", "submit", "examples/cpu_demo.yaml", "--address",
             f"http://127.0.0.1:{server.server_port}", "model.path=/models/base"],
            cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=120)
    finally:
        server.shutdown()
    assert out.returncode == 2, out.stderr
    assert "uses token authentication and no token was found" in out.stderr
    assert "~/.ray/auth_token" in out.stderr and "RAY_AUTH_TOKEN" in out.stderr and "Traceback" not in out.stderr


def test_job_on_a_python_without_our_dependencies_says_what_is_missing():
    # -S: no site-packages, as on a cluster whose Python never had raygrpo installed
    out = subprocess.run([sys.executable, "-S", "-m", "cluster.job_entry", "train", "examples/cpu_demo.yaml"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 3
    assert "lacks ray[default], torch" in out.stderr and "docker/" in out.stderr and sys.executable in out.stderr
