"""Fixtures of the Docker tests (`make docker-test`): a daemon that answers, raygrpo:cpu built from
this checkout by docker/build.sh, and a compose command.

Without a daemon every test here is skipped with the reason (CI has none), unless pytest runs
with --require-docker (as `make docker-test` does), where a missing daemon or compose fails.
"""
from __future__ import annotations

import shutil
import subprocess

import pytest
from docker_helpers import IMAGE, ROOT, run


def pytest_addoption(parser):
    parser.addoption("--require-docker", action="store_true",
                     help="fail, instead of skipping, when no Docker daemon or compose command answers")


def unavailable(config, reason: str):
    if config.getoption("--require-docker", default=False):  # registered only when tests/docker is named
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def docker_daemon(pytestconfig) -> str:
    """The daemon's version; skips (or fails under --require-docker) when none answers."""
    if shutil.which("docker") is None:
        unavailable(pytestconfig, "no `docker` command on PATH (docker/README.md, 'A daemon')")
    try:
        info = run(["docker", "info", "--format", "{{.ServerVersion}}"], timeout=30)
    except subprocess.TimeoutExpired:
        unavailable(pytestconfig, "no Docker daemon answers: `docker info` took over 30 s")
    if info.returncode != 0 or not info.stdout.strip():
        last = (info.stderr.strip().splitlines() or ["no output"])[-1]
        unavailable(pytestconfig, f"no Docker daemon answers (`docker info`: {last}); start one (docker/README.md)")
    return info.stdout.strip()


@pytest.fixture(scope="session")
def cpu_image(docker_daemon) -> str:
    """raygrpo:cpu as this checkout builds it (`make docker-cpu` just before makes this a cache hit)."""
    out = run([str(ROOT / "docker" / "build.sh"), "cpu"], timeout=3600, cwd=ROOT)
    if out.returncode != 0:
        pytest.fail(f"docker/build.sh cpu failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}", pytrace=False)
    print(out.stdout.strip().splitlines()[-1])  # "built raygrpo:cpu in N s: SIZE"
    return IMAGE


@pytest.fixture(scope="session")
def compose(docker_daemon, pytestconfig) -> list[str]:
    """`docker compose` (v2) or `docker-compose` (v1), whichever this machine has."""
    if run(["docker", "compose", "version"]).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose") and run(["docker-compose", "version"]).returncode == 0:
        return ["docker-compose"]
    unavailable(pytestconfig, "no compose command: install the compose plugin (`docker compose`) or docker-compose")
