"""Remote verifiers (actors/rewards/http.py) against real HTTP servers on 127.0.0.1: what is sent,
nulls, retries, timeouts, refusals; and examples/verifier_server.py as a user starts it."""
from __future__ import annotations

import importlib.util
import json
import math
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from local_http import EXAMPLE_VERIFIER, BackloggedServer, LocalServer, QuietHandler, example_verifier

from actors.completions import Completion
from actors.config import RewardConfig
from actors.rewards.http import TOKEN_ENV, HttpVerifier, VerifierRefused
from actors.rewards.scorer import RewardScorer


class Server:
    """A verifier whose answer to request k is `script[k]` (the last entry repeats)."""

    def __init__(self, script: list[str]):
        self.script, self.requests, self.lock = script, [], threading.Lock()
        outer = self

        class Handler(QuietHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    k = len(outer.requests)
                    outer.requests.append({"body": body, "auth": self.headers.get("Authorization"), "path": self.path})
                action = outer.script[min(k, len(outer.script) - 1)]
                n = len(body["completions"])
                if action == "hang":
                    time.sleep(3)
                    return
                if action.isdigit():
                    return self._send(int(action), {"error": f"scripted {action}"})
                if action == "nulls":
                    rewards = [None if i % 2 else 1.0 for i in range(n)]
                elif action == "short":
                    rewards = [1.0]
                else:  # ok: 1.0 when the completion ends with the answer column
                    rewards = [1.0 if str(c).endswith(str(a)) else 0.0 for c, a in zip(body["completions"], body["answer"])]
                self._send(200, {"rewards": rewards})

            def _send(self, status, payload):
                self.send(status, json.dumps(payload))

        self.local = LocalServer(Handler)
        self.url = f"{self.local.base}/verify"

    def close(self):
        self.local.close()


@pytest.fixture
def server(request):
    s = Server(request.param)
    yield s
    s.close()


def _score(url, n=4, completions=None, **cfg):
    cfg = RewardConfig(functions=[url], **{"http_timeout_s": 1.0, "http_max_retries": 2, **cfg})
    comps = completions or [Completion([7, 1], [-0.1, -0.2], f"{i}+1={i + 1}", "stop") for i in range(n)]
    with RewardScorer(cfg) as scorer:
        return scorer.score([f"{i}+1=" for i in range(len(comps))], comps,
                            [{"answer": str(i + 1), "id": i} for i in range(len(comps))], group_size=len(comps))


@pytest.mark.parametrize("server", [["ok"]], indirect=True)
def test_the_verifier_receives_the_columns_in_batches(server, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    res = _score(server.url, n=5, http_max_batch=2)
    assert res.rewards == [1.0] * 5 and res.errors == 0
    bodies = sorted((r["body"] for r in server.requests), key=lambda b: b["id"][0])
    assert [len(b["prompts"]) for b in bodies] == [2, 2, 1]  # reward.http_max_batch
    first = bodies[0]
    assert first["prompts"] == ["0+1=", "1+1="] and first["completions"] == ["0+1=1", "1+1=2"]
    assert first["answer"] == ["1", "2"] and first["id"] == [0, 1]  # every dataset column, as lists
    assert first["completion_ids"] == [[7, 1], [7, 1]] and first["_num_tokens"] == [2, 2]
    assert {r["auth"] for r in server.requests} == {"Bearer s3cret"}
    stats = res.functions["127.0.0.1_verify"]  # the name: host and path
    assert stats.calls == 3 and stats.values == [1.0] * 5 and stats.seconds > 0


@pytest.mark.parametrize("server", [["nulls"]], indirect=True)
def test_nulls_are_unscorable_not_zero(server):
    res = _score(server.url, n=4)
    assert res.rewards[0] == res.rewards[2] == 1.0 and math.isnan(res.rewards[1]) and math.isnan(res.rewards[3])
    assert res.unscorable == 2 and res.errors == 0 and res.functions["127.0.0.1_verify"].unscorable == 2


@pytest.mark.parametrize("server", [["500", "503", "ok"]], indirect=True)
def test_5xx_is_retried_with_backoff(server):
    t0 = time.monotonic()
    res = _score(server.url, n=3)
    assert res.rewards == [1.0] * 3 and res.errors == 0 and len(server.requests) == 3
    assert time.monotonic() - t0 >= 0.5 + 1.0  # backoff 0.5 s, then 1 s


@pytest.mark.parametrize("server", [["500"]], indirect=True)
def test_5xx_after_the_last_retry_is_an_error(server):
    res = _score(server.url, n=2, http_max_retries=1, fallback=-1.0)
    assert res.rewards == [-1.0, -1.0] and res.errors == 2 and len(server.requests) == 2
    assert "HTTP 500" in res.error_samples[0] and "after 2 attempts" in res.error_samples[0]


@pytest.mark.parametrize("server", [["400"]], indirect=True)
def test_other_4xx_is_an_error_and_not_retried(server):
    res = _score(server.url, n=2)
    assert res.errors == 2 and len(server.requests) == 1 and "HTTP 400" in res.error_samples[0]


@pytest.mark.parametrize("server", [["hang", "ok"]], indirect=True)
def test_a_hung_request_times_out_as_an_error(server):
    t0 = time.monotonic()
    res = _score(server.url, n=4, http_max_batch=2)
    assert time.monotonic() - t0 < 2.9  # not the server's 3 s, and the other request ran beside it
    assert res.errors == 2 and sum(r == 1.0 for r in res.rewards) == 2
    assert "no answer within 1 s (reward.http_timeout_s)" in res.error_samples[0]
    assert res.functions["127.0.0.1_verify"].timeouts == 1 and len(server.requests) == 2  # not retried


@pytest.mark.parametrize("server", [["401"]], indirect=True)
def test_401_stops_the_run_naming_the_url(server, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(VerifierRefused, match=rf"{server.url} refused.*HTTP 401.*{TOKEN_ENV} is not set"):
        _score(server.url)


@pytest.mark.parametrize("server", [["404"]], indirect=True)
def test_404_stops_the_run_naming_the_url(server):
    with pytest.raises(VerifierRefused, match=f"no reward verifier at {server.url}: HTTP 404"):
        _score(server.url)


@pytest.mark.parametrize("server", [["short"]], indirect=True)
def test_a_wrong_answer_shape_is_an_error_naming_the_protocol(server):
    res = _score(server.url, n=3)
    assert res.errors == 3 and 'answered 1 rewards for 3 samples; expected {"rewards": [3 numbers or null]}' \
        in res.error_samples[0]


def test_connection_refused_is_retried_then_an_error():
    port = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    url = f"http://127.0.0.1:{port.server_address[1]}/verify"
    port.server_close()  # nothing listens there now
    res = _score(url, n=1, http_max_retries=1)
    assert res.errors == 1 and "cannot connect" in res.error_samples[0] and "after 2 attempts" in res.error_samples[0]


def test_requests_run_concurrently():
    server = Server(["hang"])  # every request sleeps 3 s and never answers: 4 of them at once
    try:
        verifier = HttpVerifier(server.url, RewardConfig(http_timeout_s=1.0, http_concurrency=4))
        t0 = time.monotonic()
        outcomes = verifier.collect(verifier.start([{"prompts": ["p"], "completions": ["c"]}] * 4))
        assert time.monotonic() - t0 < 2.5 and all(o.timed_out for o in outcomes)
        verifier.close()
    finally:
        server.close()


def test_the_example_server_speaks_the_protocol(tmp_path):
    with example_verifier("--token", "tok") as url:
        wrong = HttpVerifier(url, RewardConfig(), token="wrong")
        with pytest.raises(VerifierRefused, match="HTTP 401"):
            wrong.collect(wrong.start([{"prompts": ["p"], "completions": ["c"]}]))
        verifier = HttpVerifier(url, RewardConfig(), token="tok")
        [outcome] = verifier.collect(verifier.start([{
            "prompts": ["1+1=", [{"role": "user", "content": "2+2?"}], "3+3="],
            "completions": ["2", [{"role": "assistant", "content": "it is 5"}], "6"],
            "answer": ["2", "4", None]}]))
        assert outcome.results == [(True, 1.0), (True, 0.0), (True, None)]


def _burst(server_class: type[ThreadingHTTPServer]) -> Counter:
    """What 32 requests sent at once got, while the server's accept loop had not started (its thread waiting, as
    a busy process's does for the GIL) until 1 s later."""
    httpd = server_class(("127.0.0.1", 0), QuietHandler)  # QuietHandler has no do_POST: each request is a 501
    url = f"http://127.0.0.1:{httpd.server_address[1]}/verify"

    def send(_):
        try:
            urllib.request.urlopen(urllib.request.Request(url, data=b"{}", method="POST"), timeout=10)
        except urllib.error.HTTPError as e:
            return f"HTTP {e.code}"
        except OSError as e:
            return type(e).__name__
        return "200"

    serving = threading.Event()

    def serve():
        serving.set()
        httpd.serve_forever()

    late = threading.Timer(1.0, serve)
    late.start()
    try:
        with ThreadPoolExecutor(32) as pool:
            return Counter(pool.map(send, range(32)))
    finally:
        late.cancel()
        if serving.is_set():  # shutdown() waits for a serve_forever that has started
            httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize("where", ["tests/local_http.py", "examples/verifier_server.py"])
def test_a_burst_of_requests_reaches_the_server_while_its_accept_loop_waits(where):
    """socketserver's backlog of 5 reset the connections past the 5th ("Connection reset by peer"): raygrpo
    retried them, and the e2e test's server counted 7 of /e500's 8 requests (CI, session 26's stop)."""
    if where == "tests/local_http.py":
        server_class = BackloggedServer
    else:
        spec = importlib.util.spec_from_file_location("verifier_server", EXAMPLE_VERIFIER)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        server_class = module.VerifierServer
    assert _burst(server_class) == Counter({"HTTP 501": 32})
