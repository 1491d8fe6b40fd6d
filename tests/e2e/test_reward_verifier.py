"""A remote verifier in a real run, through the CLI, with the verifier started by the test as a user
starts one (its own process on 127.0.0.1): what it receives, its nulls, its 500s, a hung request,
and a verifier that refuses raygrpo's credentials.

The verifier's run also carries a user reward function that kills its parent now and then (issue 30; the one
that hangs on every call is one of the broken functions of tests/e2e/test_reward_fails_alone_end_to_end.py)
and `format`: one run, started once for both claims (each CLI run starts its own Ray cluster, engine and
learner). The verifier runs in the driver, on
threads (actors/rewards/http.py); the Python function runs in the isolated worker processes
(actors/rewards/pool.py) whose keeper it kills, so neither can touch the other. Each test reads its
own function's metrics (`rewards/<name>/...`), not the run's totals, which add the two."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cluster.run.metrics import read_metrics
from tests.e2e.test_train import ROOT, run_cli

# Scores 1-digit additions like exact_match; request 1 fails with 500 (retried), request 4 hangs past
# reward.http_timeout_s (an error for its samples), the 2nd sample of every request is null.
SERVER = textwrap.dedent('''
    import json, re, sys, threading, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    LOG, lock, seen = sys.argv[1], threading.Lock(), []

    class Verifier(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                seen.append(1)
                k = len(seen)
                with open(LOG, "a") as f:
                    f.write(json.dumps({"k": k, "keys": sorted(body), "n": len(body["completions"]),
                                        "answer": body.get("answer"), "prompts": body["prompts"]}) + "\\n")
            if k == 1:
                return self.reply(500, {"error": "warming up"})
            if k == 4:
                time.sleep(60)
                return
            rewards = []
            for i, (c, a) in enumerate(zip(body["completions"], body["answer"])):
                found = re.findall(r"-?\\d+", c)
                rewards.append(None if i == 1 else float(bool(found) and found[0] == str(a)))
            self.reply(200, {"rewards": rewards})

        def reply(self, status, payload):
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Verifier)
    server.daemon_threads = True
    print(server.server_address[1], flush=True)
    server.serve_forever()
''')


def start(args: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().split()[-1]


# Kills its parent (its worker's keeper) on every call for prompts "a+b=" with a = 1 or 3 (a fifth of
# them, every call of their group); scores the others like exact_match (issue 30's case).
KILLER = textwrap.dedent("""
    import os, signal, time

    def reward(prompt, completion, answer, **kw):
        if prompt[0] in "13":  # prompts "a+b=" with a = 1 or 3: a fifth of them, every call of their group
            os.kill(os.getppid(), signal.SIGKILL)
            time.sleep(1)
        return 1.0 if completion.strip() == answer else 0.0
""")


def write_config(tmp_path: Path, tiny_model_dir, functions: list[str], *extra: str) -> Path:
    cfg = tmp_path / "verifier.yaml"
    cfg.write_text(textwrap.dedent(f"""
        model: {{path: {tiny_model_dir}}}
        data: {{train: "task:addition", task_digits: 1, num_eval: 0}}
        trainer: {{run_dir: {tmp_path / 'run'}, steps: 3, prompts_per_step: 4, group_size: 4, actor_timeout_s: 300}}
        rollout: {{max_model_len: 48, max_new_tokens: 4, gpu_memory_utilization: 0.03}}
        learner: {{micro_batch_size: 8}}
        metrics: {{tensorboard: false}}
        reward:
          functions: {json.dumps(functions)}
          http_timeout_s: 3
          http_max_batch: 8
          http_max_retries: 2
    """) + "".join(f"{line}\n" for line in extra))
    return cfg


@pytest.fixture(scope="module")
def mixed_run(tiny_model_dir, tmp_path_factory):
    """One CLI run of 3 steps scored by [the killer, format, the verifier], the verifier started first.
    (the run's directory, its stderr and return code, the verifier's metric name)"""
    tmp_path = tmp_path_factory.mktemp("verifier_and_killer")
    (tmp_path / "my_reward.py").write_text(KILLER)
    log = tmp_path / "requests.jsonl"
    server, port = start(["-c", SERVER, str(log)])
    url = f"http://127.0.0.1:{port}/verify"
    cfg = write_config(tmp_path, tiny_model_dir, ["my_reward.py:reward", "format", url],
                       "  num_procs: 2")  # a line of the reward block
    try:
        out = run_cli("train", cfg, cwd=tmp_path)
    finally:
        server.kill()
    return tmp_path, out, log


def test_a_verifier_gets_the_columns_its_nulls_are_left_out_its_500s_retried_its_hang_counted(mixed_run):
    tmp_path, out, log = mixed_run
    assert out.returncode == 0, out.stderr[-3000:]
    requests = [json.loads(line) for line in log.read_text().splitlines()]
    # 3 steps x 16 completions in batches of 8 = 6 batches; the one answered 500 was sent again (after 0.5 s)
    assert len(requests) == 7 and requests[0]["prompts"] == requests[2]["prompts"]
    assert all({"prompts", "completions", "answer", "completion_ids", "_num_tokens", "_finish_reason"} <= set(r["keys"])
               for r in requests)
    assert all(r["n"] == 8 and len(r["answer"]) == 8 for r in requests)
    assert all(str(eval(p.rstrip("="))) == a for r in requests for p, a in zip(r["prompts"], r["answer"]))  # noqa: S307
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    name = "127.0.0.1_verify"  # the URL's host and path, "/" as "_"
    # the null in each request: out of its group and the loss, counted (one per request that answered). The
    # other functions return no null, and the killer fails whole groups (left out of them), so every sample
    # the run counts unscorable is the verifier's null.
    assert [r["reward_unscorable"] for r in rows] == [r[f"rewards/{name}/unscorable"] for r in rows]
    assert sum(r["reward_unscorable"] for r in rows) == 5  # 6 batches, one hung: 5 answered with a null each
    # the hung request (4th sent: step 2's second batch): an error for its 8 samples, not retried; counted in
    # the run's total beside the killer's errors
    assert [r[f"rewards/{name}/errors"] for r in rows] == [0, 8, 0]
    assert all(r["reward_errors"] == r[f"rewards/{name}/errors"] + r["rewards/reward/errors"]
               + r["rewards/format/errors"] for r in rows)
    assert "no answer within 3 s (reward.http_timeout_s)" in out.stderr
    assert all(r[f"rewards/{name}/s"] > 0 for r in rows) and rows[1][f"rewards/{name}/s"] >= 3


def test_a_reward_that_kills_its_parent_now_and_then_costs_only_those_calls(mixed_run):
    """(issue 30; the function that hangs on every call: tests/e2e/test_reward_fails_alone_end_to_end.py; one that
    kills its parent on every call is a failed call like any other: tests/unit/test_reward_isolation.py) Each call
    that kills its worker's keeper is an error for that call alone: the run ends, format never fails."""
    tmp_path, out, _ = mixed_run
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    errors = [r["rewards/reward/errors"] for r in rows]
    assert sum(errors) > 0 and all(e % 4 == 0 for e in errors)  # whole groups: the prompt decides
    assert all(r["rewards/format/errors"] == 0 for r in rows)
    assert "reward process died (exit code -9)" in out.stderr


def test_a_verifier_that_refuses_the_credentials_stops_the_first_step_naming_the_url(tiny_model_dir, tmp_path):
    """examples/verifier_server.py with --token, as a user starts it; raygrpo without RAYGRPO_REWARD_TOKEN.

    It serves https (--cert/--key) with a certificate a CA of the test's own signed, in no system store, as a
    company's internal CA: the user's config trusts it with reward.http_ca_file, a path relative to the user's
    directory. The 401 reaching raygrpo shows the TLS connection was made."""
    tls_certs = pytest.importorskip("tls_certs", reason="the `cryptography` package makes the test's CA and certificate")
    pki = tmp_path / "pki"
    pki.mkdir()
    tls_certs.make_pki(pki)
    server, url = start([str(ROOT / "examples" / "verifier_server.py"), "--port", "0", "--token", "s3cret",
                         "--cert", str(pki / "good.pem"), "--key", str(pki / "good.key")])
    assert url.startswith("https://")
    env = {k: v for k, v in os.environ.items() if k != "RAYGRPO_REWARD_TOKEN"}
    config = write_config(tmp_path, tiny_model_dir, [url], "  http_ca_file: pki/ca.pem")
    try:
        out = subprocess.run([sys.executable, "-m", "cluster.cli", "train", str(config)],
                             capture_output=True, text=True, cwd=tmp_path, timeout=600, env=env)
    finally:
        server.kill()
    assert out.returncode != 0
    assert f"the reward verifier {url} refused raygrpo's request: HTTP 401" in out.stderr, out.stderr[-3000:]
    assert "RAYGRPO_REWARD_TOKEN is not set" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or read_metrics(tmp_path / "run") == []
    assert not (tmp_path / "run" / "raygrpo.lock").exists()

