"""Issue 36 case 4, a start that survives a busy machine: the embedded Ray start retried with its reason
(the start faked). (DeepSpeed's shared-memory op, whose first build this file once announced and whose stale
lock it named, is no longer built: tests/unit/test_rank_setup.py.)"""
import subprocess
import sys
import types

import pytest

from cluster.launch import ray_cluster
from cluster.launch.ray_cluster import RayStartFailed, child_pids, start_with_retries, stop_processes

RAY_TIMEOUT = ("The current node timed out during startup. This could happen because some of the raylet failed to "
               "startup or the GCS has become overloaded.")


def fake_start(failures: int, error: str = RAY_TIMEOUT):
    calls = []

    def start():
        calls.append(1)
        if len(calls) <= failures:
            raise Exception(error)  # what ray.init raises (ray/_private/node.py)
        return "started"
    return start, calls


def test_a_start_up_timeout_is_retried_with_the_reason_printed():
    start, calls = fake_start(failures=2)
    said, cleaned, slept = [], [], []
    assert start_with_retries(start, lambda: cleaned.append(1), say=said.append, sleep=slept.append) == "started"
    assert len(calls) == 3 and len(cleaned) == 2 and len(slept) == 2
    assert "Ray's start-up timed out (attempt 1 of 3; Ray: The current node timed out during startup" in said[0]
    assert "attempt 2 of 3" in said[1] and "load average" in said[1]


def test_the_last_failure_says_it_was_rays_start_up_and_what_to_do():
    start, calls = fake_start(failures=5)
    said = []
    with pytest.raises(RayStartFailed) as e:
        start_with_retries(start, lambda: None, say=said.append, sleep=lambda s: None)
    assert len(calls) == 3 and len(said) == 2
    text = str(e.value)
    assert text.startswith("Ray's own start-up timed out 3 times (Ray: The current node timed out during startup")
    assert "fixed 30 s" in text and "Run the same command again" in text and "ray start --head" in text
    assert "ray.address=auto" in text


def test_any_other_start_error_is_not_retried():
    start, calls = fake_start(failures=1, error="Invalid argument num_cpus")
    with pytest.raises(Exception, match="Invalid argument num_cpus"):
        start_with_retries(start, lambda: None, say=lambda t: None, sleep=lambda s: None)
    assert len(calls) == 1


def test_the_processes_a_failed_start_left_are_stopped():
    """Ray raises inside its Node's constructor, so ray.shutdown() cannot stop that attempt's GCS and raylet:
    the retry stops this process's children that the attempt started."""
    before = child_pids()
    p = subprocess.Popen(["sleep", "60"])  # what a failed attempt leaves
    try:
        assert child_pids() - before == {p.pid}
        stop_processes(child_pids() - before, grace_s=2)
        assert p.wait(timeout=5) is not None and p.pid not in child_pids()
    finally:
        if p.poll() is None:
            p.kill()


def test_the_embedded_cluster_is_always_new_and_a_jobs_ray_address_is_joined(monkeypatch, capsys):
    """ray.address empty: ray.init(address="local"), never the cluster a `ray start` left on this machine
    (ray.init() with no address joins it, then refuses num_cpus); with RAY_ADDRESS set, as Ray sets it in
    a `ray job submit` driver, that cluster is joined and the console says so (Ray faked)."""
    import ray._private.ray_constants  # noqa: F401  the real one, which loopback_only reads: imported before "ray"
    # is faked below (it passed only where an earlier test in the same process had imported it)
    inits, joined = [], []
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: False,
                                                                  init=lambda **kw: inits.append(kw)))
    monkeypatch.setattr(ray_cluster, "join_cluster", lambda address, runtime_env=None: joined.append(address))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray_cluster.start_ray("", num_cpus=8)
    assert [kw["address"] for kw in inits] == ["local"] and inits[0]["num_cpus"] == 8 and joined == []

    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    ray_cluster.start_ray("", num_cpus=8)
    assert joined == ["10.0.0.5:6379"] and len(inits) == 1
    assert "RAY_ADDRESS=10.0.0.5:6379 is set" in capsys.readouterr().out
    ray_cluster.start_ray("auto", num_cpus=8)  # an explicit ray.address wins over the environment
    assert joined == ["10.0.0.5:6379", "auto"]


def test_joining_a_running_cluster_is_said_before_ray_init(monkeypatch, capsys):
    """The embedded start says "starting an embedded Ray cluster" before ray.init; a join says where it goes
    before ray.init too, which on a busy machine takes tens of seconds with nothing else on the console."""
    said_before_init = []
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(
        init=lambda **kw: said_before_init.append(capsys.readouterr().out)))
    monkeypatch.setattr(ray_cluster, "resolve_gcs_address", lambda address: "10.0.0.5:6379")
    monkeypatch.setattr(ray_cluster, "gcs_auth_mode", lambda gcs: "disabled")
    monkeypatch.setattr(ray_cluster, "use_cluster_auth_mode", lambda mode, gcs: None)
    monkeypatch.setattr(ray_cluster, "keep_token_private", lambda: None)
    ray_cluster.join_cluster("auto")
    assert said_before_init == ["joining the Ray cluster at 10.0.0.5:6379\n"]
