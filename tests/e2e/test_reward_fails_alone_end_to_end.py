"""Reward functions that fail, partly or wholly, fail alone: one run (issue 36 item 1, issue 30, issue 58's one
run for the family), through the installed console script, from a directory of the user's. Its functions:
  - two that work: the built-in exact_match and a verifier (/ok), and `format`;
  - six broken verifiers (a 500, an answer that is not JSON, NaN, strings, booleans, an over-size answer) plus a
    URL where nothing listens; the verifiers are local HTTP servers on 127.0.0.1 started here, run by the driver
    on threads;
  - two broken user Python functions, in the reward worker processes: one raises on every call (its message is
    said and named in the halt), one hangs on every call (issue 30's hanging reward, as the adversary found it:
    each of the 2 processes' first call times out, the rest run at once, each with its own reward.timeout_s
    deadline, and the halt names it with its timeout);
  - two that fail now and then: a verifier (/mixed) that answers its first request 500 (retried), leaves the
    2nd sample of every request null (left out, counted unscorable) and holds its 4th request past
    reward.http_timeout_s (an error for its 8 samples, not retried); and a user function that kills its
    worker's keeper on the prompts "1+..." and "3+..." (issue 30: an error for those calls alone).

Each broken function fails alone: the steps go on with those that work (their weights renormalised), each step's
metrics row carries every function's error count, and after `trainer.halt_after` steps in a row the run halts
naming exactly the functions that failed every call (not those that failed now and then), each with its own first
error, its checkpoint and plots written first.

A run whose only function fails every call halts at once, after step 1's row ("no reward function scored any
sample"): the driver's decision at its seam, tests/unit/test_driver_seam.py (a step that sent no update) and
tests/unit/test_reward_fails_alone.py. (The hanging function had a run of its own that halted so, the former
tests/e2e/test_reward_faults.py, and the now-and-then functions one that ran 3 steps, the former
test_reward_verifier.py's mixed run; issue 58, two engine starts fewer.)
"""
from __future__ import annotations

import json
import math
import re
import shutil
import socket
import threading
import time
from collections import Counter

import pytest
import yaml
from console import run
from local_http import LocalServer, QuietHandler

from cluster.run.metrics import read_metrics

pytestmark = pytest.mark.timeout(900)

BIG = 2 * 1024 * 1024  # bytes of the /big answer; the run caps answers at 1 MB


class Verifiers:
    """One server, a verifier per path: /ok scores like exact_match, /mixed fails now and then (the module's
    docstring), the others are broken each its own way."""

    def __init__(self):
        self.requests: Counter = Counter()
        self.mixed: list[dict] = []  # what /mixed was sent, request by request
        lock, outer = threading.Lock(), self

        class Handler(QuietHandler):
            def do_POST(self):  # noqa: N802 - the name http.server calls
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    outer.requests[self.path] += 1
                    k = outer.requests[self.path]
                    if self.path == "/mixed":  # logged in the order received
                        outer.mixed.append({"k": k, "keys": sorted(body), "n": len(body["completions"]),
                                            "answer": body.get("answer"), "prompts": body["prompts"]})
                n = len(body["completions"])
                if self.path == "/mixed":
                    return self.mixed(k, body)
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

            def mixed(self, k: int, body: dict) -> None:
                if k == 1:
                    return self.send(500, '{"error": "warming up"}')
                if k == 4:
                    time.sleep(60)  # past reward.http_timeout_s: raygrpo has given up on it
                    return None
                rewards = []
                for i, (c, a) in enumerate(zip(body["completions"], body["answer"])):
                    found = re.findall(r"-?\d+", c)
                    rewards.append(None if i == 1 else float(bool(found) and found[0] == str(a)))
                return self.send(200, json.dumps({"rewards": rewards}))

        self.local = LocalServer(Handler)
        self.base = self.local.base

    def close(self):
        self.local.close()


def bound_not_listening() -> socket.socket:
    """A port where nothing listens (a connect is refused), held for the test: a port closed at once could be
    taken by any bind(0) on the machine (gloo, Ray) before the run's calls reach it."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s


BROKEN = {"e500": "HTTP 500", "notjson": "not JSON", "nan": "returned nan", "strings": "returned '1.0'",
          "bool": "returned True", "big": "more than 1 MB (reward.http_max_response_mb=1)",
          "nolisten": "cannot connect", "raises": "boom from user code", "slow_judge": "timed out after 3s"}

USER_REWARDS = """
import os
import signal
import time


def killer(prompt, completion, answer, **kw):
    if prompt[0] in "13":  # prompts "a+b=" with a = 1 or 3: every call of their group kills its worker's keeper
        os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(1)
    return 1.0 if completion.strip() == answer else 0.0


def raises(prompt, completion, **kw):
    raise RuntimeError('boom from user code')


def slow_judge(prompt, completion, **kw):
    time.sleep(3600)
"""


def test_broken_verifiers_fail_alone_and_the_halt_names_exactly_them(tmp_path, tiny_model_dir):
    home = tmp_path / "user"
    shutil.copytree(tiny_model_dir, home / "model")
    (home / "my_rewards.py").write_text(USER_REWARDS)
    servers, nolisten = Verifiers(), bound_not_listening()
    urls = [f"{servers.base}/{p}" for p in ("ok", "e500", "notjson", "nan", "strings", "bool", "big", "mixed")]
    # the killer before the hanging function: the pool runs a batch's calls in this order, so every kill is over
    # before a call of slow_judge is sent (a kill takes the calls in flight on its worker with it)
    names = ["exact", "format", "ok", "e500", "notjson", "nan", "strings", "bool", "big", "mixed", "nolisten", "killer",
             "raises", "slow_judge"]
    cfg = {"model": {"path": "model"}, "data": {"train": "task:addition", "task_digits": 1, "num_eval": 0},
           "trainer": {"steps": 3, "prompts_per_step": 4, "group_size": 4, "run_dir": "runs/verifiers",
                       "actor_timeout_s": 600, "halt_after": 2},
           "rollout": {"max_model_len": 48, "max_new_tokens": 4, "gpu_memory_utilization": 0.03},
           "learner": {"micro_batch_size": 8}, "metrics": {"tensorboard": False},
           "reward": {"functions": ["exact_match", "format", *urls, f"http://127.0.0.1:{nolisten.getsockname()[1]}/nolisten",
                                    "my_rewards.py:killer", "my_rewards.py:raises", "my_rewards.py:slow_judge"],
                      "names": names, "num_procs": 2, "timeout_s": 3, "http_timeout_s": 10, "http_max_retries": 1, "http_max_batch": 8,
                      "http_max_response_mb": 1}}
    (home / "run.yaml").write_text(yaml.safe_dump(cfg))
    try:
        out = run(["train", "run.yaml"], home)
    finally:
        servers.close()
        nolisten.close()
    out.report("14 reward functions, 9 broken, 2 failing now and then")
    text = out.text
    assert out.returncode == 3, text[-4000:]  # halted by the guard, after the checkpoint of step 2
    assert "every reward call failed" not in text and "Traceback" not in text
    rows = read_metrics(home / "runs" / "verifiers")
    assert [r["step"] for r in rows] == [1, 2], text[-4000:]  # each step's row written, the halt's too
    for r in rows:
        assert r["rewards/exact/errors"] == r["rewards/ok/errors"] == r["rewards/format/errors"] == 0
        assert all(r[f"rewards/{n}/errors"] == 16 for n in BROKEN), r  # 4 prompts x 4 completions
        assert math.isfinite(r["reward_mean"])
        assert r["reward_errors"] == 16 * len(BROKEN) + r["rewards/mixed/errors"] + r["rewards/killer/errors"], r
        assert r["update_skipped"] is False  # the working functions scored every sample: trained on
    # each broken function said, when it happened, its own first error
    for n, why in BROKEN.items():
        assert re.search(rf"reward: {n} failed 16 of 16 sample\(s\).*{re.escape(why)}", text), (n, text[-6000:])
    halt = [line for _, line in out.lines if line.startswith("raygrpo: run halted:")]
    assert halt, text[-4000:]
    said = re.findall(r"the reward function (\S+) failed every call", halt[0])
    assert sorted(said) == sorted(BROKEN), halt[0]  # exactly the broken ones: not exact, ok, format, mixed, killer
    for n, why in BROKEN.items():
        assert why in halt[0], (n, halt[0])
    assert "for 2 consecutive steps" in halt[0] and "step-00000002 was saved" in halt[0]
    assert "the reward function slow_judge failed every call (16 error(s), every call timed out (reward.timeout_s=3))" \
        in halt[0], halt[0]
    # Each of the 2 processes takes one first call; their deadlines are the time between the two sends apart, so a
    # loaded machine may see the first expire alone ("1 of its first 1"), the other still in flight (14 left) or, its
    # process still being replaced after the killer's last kill, not yet sent (15 left): every other call at once
    together = re.findall(r"rewards: slow_judge timed out on ([12]) of its first \1 calls: its other (\d+) run at once "
                          r"now, each with its own 3 s deadline", text)
    assert len(together) == 2, text[-6000:]  # at each step: never one call after another
    assert all(int(first) + int(left) in (15, 16) and int(left) in (14, 15) for first, left in together), together
    assert all((home / "runs" / "verifiers" / f).is_file() for f in ("reward.png", "kl.png", "step_time.png"))
    assert (home / "runs" / "verifiers" / "config.yaml").exists()  # what was written stays
    assert not (home / "runs" / "verifiers" / "raygrpo.lock").exists()  # a halted run releases its lock
    # 2 steps x 2 requests x (1 try + 1 retry: http_max_retries)
    said_e500 = [line for _, line in out.lines if "/e500" in line]
    assert servers.requests["/e500"] == 2 * 2 * 2, (servers.requests, said_e500)
    assert servers.requests["/ok"] == 2 * 2, servers.requests

    # /mixed: 2 steps x 16 completions in batches of 8 = 4 requests; the one answered 500 was sent again (after 0.5 s),
    # once: step 1's requests are the first 3 received, the retry the 2nd or the 3rd (the other batch's request may
    # reach the server after the retry: the threads of the run's 8 verifiers share the driver's cores; seen at load 2)
    requests = servers.mixed
    assert len(requests) == 5 and [r["k"] for r in requests] == [1, 2, 3, 4, 5], requests
    assert [r["prompts"] == requests[0]["prompts"] for r in requests[1:3]].count(True) == 1, requests[:3]
    assert all({"prompts", "completions", "answer", "completion_ids", "_num_tokens", "_finish_reason"} <= set(r["keys"])
               for r in requests)
    assert all(r["n"] == 8 and len(r["answer"]) == 8 for r in requests)
    assert all(str(eval(p.rstrip("="))) == a for r in requests for p, a in zip(r["prompts"], r["answer"]))  # noqa: S307
    # the null in each answered request: out of its group and the loss, counted. No other function returns a null
    # (the broken ones fail, the killer fails whole groups), so every sample the run counts unscorable is /mixed's.
    assert [r["reward_unscorable"] for r in rows] == [r["rewards/mixed/unscorable"] for r in rows]
    assert sum(r["reward_unscorable"] for r in rows) == 3  # 4 batches, one hung: 3 answered with a null each
    # the hung request (4th sent: step 2's first batch): an error for its 8 samples, not retried
    assert [r["rewards/mixed/errors"] for r in rows] == [0, 8]
    assert "no answer within 10 s (reward.http_timeout_s)" in text
    assert all(r["rewards/mixed/s"] > 0 for r in rows) and rows[1]["rewards/mixed/s"] >= 10

    # the killer: each call that kills its worker's keeper is an error for that call alone, whole groups (the prompt
    # decides: steps 1 and 2 each have one "1+..." prompt), and the run goes on
    errors = [r["rewards/killer/errors"] for r in rows]
    assert sum(errors) > 0 and all(e % 4 == 0 for e in errors), errors
    assert "reward process died (exit code -9)" in text


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
