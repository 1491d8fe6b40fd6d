"""A remote verifier in a real run, through the CLI, with the verifier started by the test as a user
starts one (its own process on 127.0.0.1): what it receives, its nulls, its 500s, a hung request,
and a verifier that refuses raygrpo's credentials."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

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


def write_config(tmp_path: Path, tiny_model_dir, url: str, *extra: str) -> Path:
    cfg = tmp_path / "verifier.yaml"
    cfg.write_text(textwrap.dedent(f"""
        model: {{path: {tiny_model_dir}}}
        data: {{train: "task:addition", task_digits: 1, num_eval: 0}}
        trainer: {{run_dir: {tmp_path / 'run'}, steps: 3, prompts_per_step: 4, group_size: 4, actor_timeout_s: 300}}
        rollout: {{max_model_len: 48, max_new_tokens: 4, gpu_memory_utilization: 0.03}}
        learner: {{micro_batch_size: 8}}
        metrics: {{tensorboard: false}}
        reward:
          functions: ["{url}"]
          http_timeout_s: 3
          http_max_batch: 8
          http_max_retries: 2
    """) + "".join(f"{line}\n" for line in extra))
    return cfg


def test_a_verifier_gets_the_columns_its_nulls_are_left_out_its_500s_retried_its_hang_counted(tiny_model_dir, tmp_path):
    log = tmp_path / "requests.jsonl"
    server, port = start(["-c", SERVER, str(log)])
    url = f"http://127.0.0.1:{port}/verify"
    try:
        out = run_cli("train", write_config(tmp_path, tiny_model_dir, url), cwd=tmp_path)
    finally:
        server.kill()
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
    # the null in each request: out of its group and the loss, counted (one per request that answered)
    assert [r["reward_unscorable"] for r in rows] == [r[f"rewards/{name}/unscorable"] for r in rows]
    assert sum(r["reward_unscorable"] for r in rows) == 5  # 6 batches, one hung: 5 answered with a null each
    # the hung request (4th sent: step 2's second batch): an error for its 8 samples, not retried
    assert [r["reward_errors"] for r in rows] == [0, 8, 0] and rows[1][f"rewards/{name}/errors"] == 8
    assert "no answer within 3 s (reward.http_timeout_s)" in out.stderr
    assert all(r[f"rewards/{name}/s"] > 0 for r in rows) and rows[1][f"rewards/{name}/s"] >= 3


def test_a_verifier_that_refuses_the_credentials_stops_the_first_step_naming_the_url(tiny_model_dir, tmp_path):
    """examples/verifier_server.py with --token, as a user starts it; raygrpo without RAYGRPO_REWARD_TOKEN."""
    server, url = start([str(ROOT / "examples" / "verifier_server.py"), "--port", "0", "--token", "s3cret"])
    env = {k: v for k, v in os.environ.items() if k != "RAYGRPO_REWARD_TOKEN"}
    try:
        out = subprocess.run([sys.executable, "-m", "cluster.cli", "train", str(write_config(tmp_path, tiny_model_dir, url))],
                             capture_output=True, text=True, cwd=tmp_path, timeout=600, env=env)
    finally:
        server.kill()
    assert out.returncode != 0
    assert f"the reward verifier {url} refused raygrpo's request: HTTP 401" in out.stderr
    assert "RAYGRPO_REWARD_TOKEN is not set" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or read_metrics(tmp_path / "run") == []
    assert not (tmp_path / "run" / "raygrpo.lock").exists()

