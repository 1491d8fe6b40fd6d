"""cluster/launch/submit.py: what travels with a job, what its entrypoint runs, the wait for Ray's job agent.
The job submission client is faked here; tests/e2e/test_external_cluster.py submits to a real head."""
import http.server
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from cluster.config import RunConfig
from cluster.launch import submit, submit_client
from cluster.launch.upload_check import UploadProblem, check_upload
from cluster.paths import PROJECT_ROOT


def test_a_config_in_the_checkout_uploads_the_checkout():
    wd, rel, modules = submit.plan(PROJECT_ROOT / "examples" / "cpu_demo.yaml", None)
    assert (wd, rel, modules) == (PROJECT_ROOT, Path("examples/cpu_demo.yaml"), [])


def test_a_config_outside_uploads_its_directory_with_raygrpo_beside_it(tmp_path):
    (tmp_path / "configs").mkdir()
    cfg = tmp_path / "configs" / "run.yaml"
    wd, rel, modules = submit.plan(cfg, None)
    assert wd == tmp_path / "configs" and rel == Path("run.yaml")
    assert modules == [str(PROJECT_ROOT / p) for p in ("actors", "learner", "cluster")]
    wd, rel, _ = submit.plan(cfg, str(tmp_path))  # --working-dir: the project root above the config
    assert wd == tmp_path and rel == Path("configs/run.yaml")
    with pytest.raises(submit.SubmitError, match="is not inside the working dir"):
        submit.plan(cfg, str(PROJECT_ROOT))
    with pytest.raises(submit.SubmitError, match="is not a directory"):
        submit.plan(cfg, str(tmp_path / "nope"))


def test_the_files_a_config_names_are_checked_as_the_job_will_see_them(tmp_path):
    (tmp_path / "rewards.py").write_text("def f(prompt, completion, **kw): return 0.0\n")
    cfg = RunConfig()
    cfg.reward.functions = ["rewards.py:f", "exact_match"]
    cfg.rollout.env = "envs/tool_env.py:ToolEnv"
    cfg.data.train = f"{tmp_path}/train.jsonl,/shared/data/more.jsonl"
    cfg.trainer.run_dir = "runs/x"
    problems, warnings = submit.file_problems(cfg, tmp_path)
    assert len(problems) == 2
    assert f"rollout.env 'envs/tool_env.py:ToolEnv': {tmp_path}/envs/tool_env.py does not exist" in problems[0]
    assert "absolute path inside the working dir" in problems[1] and ": train.jsonl" in problems[1]
    assert any("/shared/data/more.jsonl" in w and "must exist at that path" in w for w in warnings)
    assert any("trainer.run_dir 'runs/x' is relative" in w for w in warnings)


def test_the_working_dir_entrypoint_finds_job_entry_through_pythonpath(tmp_path):
    """In working-dir mode the job's shell runs cluster/job_entry.sh from raygrpo's py_modules copy,
    wherever Ray unpacked it; every argument arrives as it was given."""
    fake = tmp_path / "_ray_pkg_1" / "cluster"
    fake.mkdir(parents=True)
    (fake / "job_entry.sh").write_text('printf "%s|" "$@"\n')
    command = submit.entrypoint(Path("cfg dir/run.yaml"), ["reward.functions=['a.py:f']"], "WARNING", ["x"])
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}/elsewhere:{tmp_path / '_ray_pkg_1'}"}
    out = subprocess.run(command, shell=True, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "train|cfg dir/run.yaml|reward.functions=['a.py:f']|--log-level|WARNING|ray.address=auto|"
    out = subprocess.run(command, shell=True, env={**env, "PYTHONPATH": str(tmp_path)}, capture_output=True, text=True)
    assert out.returncode == 3 and "cluster/job_entry.sh is on none of this job's PYTHONPATH" in out.stderr
    assert submit.entrypoint(Path("examples/c.yaml"), [], "INFO", []).startswith("sh cluster/job_entry.sh train examples/c.yaml")


class FakeClient:
    def __init__(self, failures: list[str]):
        self.failures, self.calls, self.ids = list(failures), 0, []

    def submit_job(self, **job):
        self.calls += 1
        self.ids.append(job.get("submission_id"))
        if self.failures:
            raise RuntimeError(self.failures.pop(0).format(id=job.get("submission_id")))
        return "raysubmit_1"


def clock_and_sleep():
    now = [0.0]
    return (lambda: now[0]), (lambda s: now.__setitem__(0, now[0] + s))


def test_submit_waits_for_the_job_agent_and_says_so_once():
    said = []
    clock, sleep = clock_and_sleep()
    agent = "Request failed with status code 500: No available agent to submit job, please try again later."
    client = FakeClient([agent, agent])
    job = submit.submit_waiting_for_agent(client, "http://h:8265", 60, say=lambda *a, **k: said.append(a[0]),
                                          sleep=sleep, clock=clock, entrypoint="x")
    assert job == "raysubmit_1" and client.calls == 3
    assert len(said) == 1 and "no job agent ready yet" in said[0] and "waiting up to 60 s" in said[0]


def test_a_connection_dropped_before_the_answer_is_tried_again_under_the_same_submission_id():
    """Seen under load: the head's job endpoint answered 500 after Ray's own wait for an agent and closed the
    connection. The retry carries the first try's id; where that try made the job, Ray says so and it is ours."""
    said = []
    clock, sleep = clock_and_sleep()
    dropped = "('Connection aborted.', RemoteDisconnected('Remote end closed connection without response'))"
    client = FakeClient([dropped])
    assert submit.submit_waiting_for_agent(client, "http://h:8265", 60, say=lambda *a, **k: said.append(a[0]),
                                           sleep=sleep, clock=clock, entrypoint="x") == "raysubmit_1"
    assert client.calls == 2 and client.ids[0] == client.ids[1] and client.ids[0].startswith("raysubmit_")
    assert len(said) == 1 and "dropped the connection" in said[0]
    made = FakeClient([dropped, "Job with submission_id {id} already exists. Please use a different submission_id."])
    job = submit.submit_waiting_for_agent(made, "http://h:8265", 60, say=lambda *a, **k: None, sleep=sleep, clock=clock)
    assert job == made.ids[0] and made.calls == 2
    with pytest.raises(RuntimeError, match="already exists"):  # on a first try it is not ours: raised as it is
        submit.submit_waiting_for_agent(FakeClient(["Job with submission_id {id} already exists."]), "http://h:8265", 60,
                                        sleep=sleep, clock=clock)


def test_an_agent_that_never_comes_is_explained():
    clock, sleep = clock_and_sleep()
    client = FakeClient(["500: No available agent to submit job, please try again later."] * 100)
    with pytest.raises(submit.AgentUnavailable) as e:
        submit.submit_waiting_for_agent(client, "http://h:8265", 10, say=lambda *a, **k: None, sleep=sleep, clock=clock)
    assert "--dashboard-agent-listen-port" in str(e.value) and "still starting" in str(e.value)
    assert "after 10 s" in str(e.value) and client.calls == 6
    with pytest.raises(RuntimeError, match="something else"):  # any other error: at once, unchanged
        submit.submit_waiting_for_agent(FakeClient(["something else"]), "http://h:8265", 10, sleep=sleep, clock=clock)


def test_a_working_dir_over_rays_100_mib_upload_limit_is_refused_naming_its_largest_entries(tmp_path):
    """Issue 59, item 7: a 200 MB working dir passed the 512 MiB check and failed on the dashboard's 100 MiB request
    limit with a raw "status code 413"."""
    with open(tmp_path / "weights.bin", "wb") as f:  # sparse: 150 MiB by size, nothing on the disk
        f.truncate(150 * 2**20)
    (tmp_path / "train.yaml").write_text("trainer: {}\n")
    with pytest.raises(UploadProblem) as e:
        check_upload(tmp_path, submit.SUBMIT_EXCLUDES)
    assert "more than 100 MiB (Ray's upload limit: its dashboard refuses a larger request, HTTP 413)" in str(e.value)
    assert "weights.bin (150 MiB)" in str(e.value)
    (tmp_path / ".rayignore").write_text("weights.bin\n")
    assert check_upload(tmp_path, submit.SUBMIT_EXCLUDES) < 2**20


def test_a_413_from_the_cluster_is_said_with_the_limit():
    raw = RuntimeError("Request failed with status code 413: Maximum request body size 104857600 exceeded, actual body "
                       "size 209715200.")
    out = submit_client.translate(raw, "http://head:8265", "uploading the working dir", 60)
    assert "refused the upload (uploading the working dir) as too large (HTTP 413)" in str(out)
    assert "at most 100 MiB in one request" in str(out)


@pytest.fixture
def plain_http_server():
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def test_https_to_a_server_speaking_plain_http_names_the_tls_mismatch(plain_http_server):
    """Issue 59, item 5: `raygrpo submit` to an https:// address served by plain HTTP said "nothing answers at ..."."""
    address = f"https://127.0.0.1:{plain_http_server}"
    with pytest.raises(submit_client.ClusterUnreachable) as e:
        submit_client.bounded(lambda: submit_client.make_client(address, 5), "asking for its Ray version", address, 5,
                              say=lambda text: None)
    assert f"{address} is an https:// address, but what answers there speaks plain HTTP" in str(e.value)
    assert f"Use http://127.0.0.1:{plain_http_server}" in str(e.value) and "nothing answers" not in str(e.value)


def test_the_waiting_line_states_the_bound_the_wait_really_has(monkeypatch):
    """Issue 59, item 5: with --agent-wait 20 the line read "25s so far, at most 20s" and the wait ended at 35 s. The
    line states the whole call's bound (the request's read timeout, its connect timeout, the probe before it), and
    the error comes then."""
    monkeypatch.setattr(submit_client, "WAITING_LINE_EVERY_S", 0.5)
    monkeypatch.setattr(submit_client, "CONNECT_TIMEOUT_S", 1.0)
    monkeypatch.setattr(submit_client, "RAY_AGENT_ANSWER_S", -4.0)  # request_timeout(1) = 1
    said, t0 = [], time.monotonic()
    with pytest.raises(submit_client.ClusterUnreachable) as e:
        submit_client.bounded(lambda: time.sleep(10), "asking", "http://head:8265", 1.0, say=said.append, extra_s=1.0)
    waited = time.monotonic() - t0
    assert said and all(line.endswith("at most 3s") for line in said), said
    assert 3.0 <= waited < 4.0 and "did not answer within 3s" in str(e.value)
