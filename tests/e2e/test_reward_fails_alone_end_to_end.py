"""Issue 36, item 1, as found: one run whose reward functions are a working built-in, a working verifier
and six broken ones (a 500, an answer that is not JSON, NaN, strings, booleans, an over-size answer)
plus a URL where nothing listens; the verifiers are local HTTP servers on 127.0.0.1 started here.
Two user Python functions are broken too (they run in the reward worker processes, the verifiers in the
driver): one raises on every call, its error said and the halt naming it with its message; one hangs on every
call (issue 30's hanging reward, as the adversary found it): each of the 2 processes' first call times out, the
rest run at once, each with its own reward.timeout_s deadline, and the halt names it with its timeout.

Each broken function fails alone: the steps go on with the two that work (their weights renormalised),
each step's metrics row carries every function's error count, and after `trainer.halt_after` steps in a
row the run halts naming exactly the broken functions, each with its own first error, its checkpoint and
plots written first. Through the installed console script, from a directory of the user's.

A run whose only function fails every call halts at once, after step 1's row ("no reward function scored any
sample"): the driver's decision at its seam, tests/unit/test_driver_seam.py (a step that sent no update) and
tests/unit/test_reward_fails_alone.py. (The hanging function had a run of its own that halted so: the former
tests/e2e/test_reward_faults.py; issue 58, one engine start fewer.)
"""
from __future__ import annotations

import json
import math
import re
import shutil
import socket
from collections import Counter

import pytest
import yaml
from console import run
from local_http import LocalServer, QuietHandler

from cluster.run.metrics import read_metrics

pytestmark = pytest.mark.timeout(900)

BIG = 2 * 1024 * 1024  # bytes of the /big answer; the run caps answers at 1 MB


class Verifiers:
    """One server, a verifier per path: /ok scores like exact_match, the others are broken each its own way."""

    def __init__(self):
        self.requests: Counter = Counter()
        outer = self

        class Handler(QuietHandler):
            def do_POST(self):  # noqa: N802 - the name http.server calls
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests[self.path] += 1
                n = len(body["completions"])
                if self.path == "/ok":
                    return self.send(200, json.dumps({"rewards": [
                        float(c.strip() == str(a)) for c, a in zip(body["completions"], body["answer"])]}))
                if self.path == "/e500":
                    return self.send(500, '{"error": "internal"}')
                if self.path == "/notjson":
                    return self.send(200, "<html>busy</html>")
                if self.path == "/nan":
                    return self.send(200, '{"rewards": [' + ", ".join(["NaN"] * n) + "]}")
                if self.path == "/strings":
                    return self.send(200, json.dumps({"rewards": ["1.0"] * n}))
                if self.path == "/bool":
                    return self.send(200, json.dumps({"rewards": [True] * n}))
                if self.path == "/big":
                    return self.send(200, json.dumps({"rewards": [1.0] * n, "pad": "x" * BIG}))
                self.send(404, "{}")

        self.local = LocalServer(Handler)
        self.base = self.local.base

    def close(self):
        self.local.close()


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return port


BROKEN = {"e500": "HTTP 500", "notjson": "not JSON", "nan": "returned nan", "strings": "returned '1.0'",
          "bool": "returned True", "big": "more than 1 MB (reward.http_max_response_mb=1)",
          "nolisten": "cannot connect", "raises": "boom from user code", "slow_judge": "timed out after 3s"}

USER_REWARDS = """
import time


def raises(prompt, completion, **kw):
    raise RuntimeError('boom from user code')


def slow_judge(prompt, completion, **kw):
    time.sleep(3600)
"""


def test_broken_verifiers_fail_alone_and_the_halt_names_exactly_them(tmp_path, tiny_model_dir):
    home = tmp_path / "user"
    shutil.copytree(tiny_model_dir, home / "model")
    (home / "my_rewards.py").write_text(USER_REWARDS)
    servers = Verifiers()
    urls = [f"{servers.base}/{p}" for p in ("ok", "e500", "notjson", "nan", "strings", "bool", "big")]
    names = ["exact", "ok", "e500", "notjson", "nan", "strings", "bool", "big", "nolisten", "raises", "slow_judge"]
    cfg = {"model": {"path": "model"}, "data": {"train": "task:addition", "task_digits": 1, "num_eval": 0},
           "trainer": {"steps": 3, "prompts_per_step": 4, "group_size": 4, "run_dir": "runs/verifiers",
                       "actor_timeout_s": 300, "halt_after": 2},
           "rollout": {"max_model_len": 48, "max_new_tokens": 4, "gpu_memory_utilization": 0.03},
           "learner": {"micro_batch_size": 8}, "metrics": {"tensorboard": False},
           "reward": {"functions": ["exact_match", *urls, f"http://127.0.0.1:{closed_port()}/nolisten",
                                    "my_rewards.py:raises", "my_rewards.py:slow_judge"],
                      "names": names, "num_procs": 2, "timeout_s": 3, "http_timeout_s": 10, "http_max_retries": 1, "http_max_batch": 8,
                      "http_max_response_mb": 1}}
    (home / "run.yaml").write_text(yaml.safe_dump(cfg))
    try:
        out = run(["train", "run.yaml"], home)
    finally:
        servers.close()
    out.report("11 reward functions, 9 broken")
    text = out.text
    assert out.returncode == 3, text[-4000:]  # halted by the guard, after the checkpoint of step 2
    assert "every reward call failed" not in text and "Traceback" not in text
    rows = read_metrics(home / "runs" / "verifiers")
    assert [r["step"] for r in rows] == [1, 2], text[-4000:]  # each step's row written, the halt's too
    for r in rows:
        assert r["rewards/exact/errors"] == r["rewards/ok/errors"] == 0
        assert all(r[f"rewards/{n}/errors"] == 16 for n in BROKEN), r  # 4 prompts x 4 completions
        assert math.isfinite(r["reward_mean"]) and r["reward_errors"] == 16 * len(BROKEN)
        assert r["update_skipped"] is False  # the two working functions scored every sample: trained on
    # each broken function said, when it happened, its own first error
    for n, why in BROKEN.items():
        assert re.search(rf"reward: {n} failed 16 of 16 sample\(s\).*{re.escape(why)}", text), (n, text[-6000:])
    halt = [line for _, line in out.lines if line.startswith("raygrpo: run halted:")]
    assert halt, text[-4000:]
    said = re.findall(r"the reward function (\S+) failed every call", halt[0])
    assert sorted(said) == sorted(BROKEN), halt[0]  # exactly the broken ones: not exact, not ok
    for n, why in BROKEN.items():
        assert why in halt[0], (n, halt[0])
    assert "for 2 consecutive steps" in halt[0] and "step-00000002 was saved" in halt[0]
    assert "the reward function slow_judge failed every call (16 error(s), every call timed out (reward.timeout_s=3))" \
        in halt[0], halt[0]
    # Each of the 2 processes takes one first call; their deadlines are the time between the two sends apart, so a
    # loaded machine may see the first expire alone ("1 of its first 1", the other still in flight: 14 left either way)
    together = re.findall(r"rewards: slow_judge timed out on ([12]) of its first \1 calls: its other 14 run at once now, "
                          r"each with its own 3 s deadline", text)
    assert len(together) == 2, text[-6000:]  # at each step: never one call after another
    assert all((home / "runs" / "verifiers" / f).is_file() for f in ("reward.png", "kl.png", "step_time.png"))
    assert (home / "runs" / "verifiers" / "config.yaml").exists()  # what was written stays
    assert not (home / "runs" / "verifiers" / "raygrpo.lock").exists()  # a halted run releases its lock
    assert servers.requests["/e500"] == 2 * 2 * 2  # 2 steps x 2 requests x (1 try + 1 retry: http_max_retries)
    assert servers.requests["/ok"] == 2 * 2


def test_a_causal_lm_given_as_a_reward_model_is_refused_without_a_false_clause_about_labels(tmp_path, tiny_model_dir):
    """Issue 36, item 5: `model:PATH` of a causal LM got the right error plus "has 2 labels" (transformers'
    default in a causal LM's config, not a property of the model). Refused at start, before Ray."""
    home = tmp_path / "user"
    shutil.copytree(tiny_model_dir, home / "model")
    cfg = {"model": {"path": "model"}, "data": {"train": "task:addition", "task_digits": 1, "num_eval": 0},
           "trainer": {"steps": 1, "prompts_per_step": 2, "group_size": 2, "run_dir": "runs/causal"},
           "reward": {"functions": ["model:model"]}, "metrics": {"tensorboard": False}}
    (home / "run.yaml").write_text(yaml.safe_dump(cfg))
    out = run(["train", "run.yaml"], home, timeout=300)
    assert out.returncode == 2, out.text[-3000:]
    assert "ForCausalLM, not a ...ForSequenceClassification model" in out.text, out.text[-3000:]
    assert "labels;" not in out.text and "Traceback" not in out.text
