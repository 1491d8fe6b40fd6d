"""A remote verifier that refuses raygrpo's credentials, in a real run through the CLI, with the verifier
(examples/verifier_server.py) started by the test as a user starts one (its own process on 127.0.0.1, https with
a company's own CA): the run stops at its first step naming the URL and the missing token.

What a verifier receives, its nulls, its 500s and a hung request, and a user function that kills its parent now
and then, are shown in the run of tests/e2e/test_reward_fails_alone_end_to_end.py, beside the broken functions
(formerly a 3-step run of their own here: issue 58, one engine start fewer); a verifier refusing a request is
also tested without a run (tests/unit/test_reward_http_bounds.py: a 401 named and asked once, not retried)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cluster.run.metrics import read_metrics
from tests.e2e.test_train import ROOT


def start(args: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().split()[-1]


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

