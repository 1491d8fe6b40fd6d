"""Every wait on a remote verifier is bounded, and the bound is the setting's (issue 36): a verifier that
hangs ends at reward.http_timeout_s, named; a 401 is asked once, not retried; reward.http_max_retries
is the number of retries the server sees; an answer over reward.http_max_response_mb is an error for
its request, read no further than the cap + 1 byte. Real HTTP servers on 127.0.0.1, counting requests."""
from __future__ import annotations

import json
import threading
import time

import pytest
from local_http import LocalServer, QuietHandler

from actors.config import RewardConfig
from actors.rewards.http import TOKEN_ENV, VerifierRefused
from actors.rewards.scorer import RewardScorer

MB = 1024 * 1024


class Verifier:
    """Answers every request with `action`: "hang", a status code, "big" (with a Content-Length),
    "big-chunked" (none: the body streams until the client stops reading) or "ok"."""

    def __init__(self, action: str, big: int = 3 * MB):
        self.requests, self.sent, self.lock = 0, 0, threading.Lock()
        padded = b'{"rewards": [1.0, 1.0], "pad": "' + b"x" * big + b'"}'  # made once: 64 MB take a while
        outer = self

        class Handler(QuietHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):  # noqa: N802
                n = len(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["completions"])
                with outer.lock:
                    outer.requests += 1
                if action == "hang":
                    time.sleep(5)
                    return
                if action.isdigit():
                    return self.send(int(action), b'{"error": "scripted"}')
                if action == "ok":
                    return self.send(200, json.dumps({"rewards": [1.0] * n}).encode())
                body = padded  # (two samples per request in these tests)
                if action == "big":
                    return self.send(200, body)
                self.send_response(200)  # big-chunked: no Content-Length, written in 64 KiB chunks
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    for i in range(0, len(body), 65536):
                        part = body[i:i + 65536]
                        self.wfile.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
                        with outer.lock:
                            outer.sent += len(part)
                    self.wfile.write(b"0\r\n\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.local = LocalServer(Handler)
        self.url = f"{self.local.base}/verify"

    def close(self):
        self.local.close()


@pytest.fixture
def verifier(request):
    v = Verifier(*request.param) if isinstance(request.param, tuple) else Verifier(request.param)
    yield v
    v.close()


def score(url: str, n: int = 2, **cfg):
    cfg = RewardConfig(functions=[url], names=["v"], **{"http_timeout_s": 1.0, "http_max_retries": 2, **cfg})
    with RewardScorer(cfg) as scorer:
        return scorer.score(["1+1="] * n, ["2"] * n, [{"answer": "2"}] * n, group_size=n)


@pytest.mark.parametrize("verifier", ["hang"], indirect=True)
def test_a_verifier_that_hangs_is_bounded_by_http_timeout_s_and_named(verifier):
    t0 = time.monotonic()
    res = score(verifier.url, http_timeout_s=1.0)
    took = time.monotonic() - t0
    assert took < 4, f"waited {took:.1f} s on a 1 s timeout"  # the server would hold it 5 s
    assert res.errors == 2 and verifier.requests == 1  # a timeout is not retried
    assert res.error_samples[0].startswith(f"v on sample 0: {verifier.url}: no answer within 1 s (reward.http_timeout_s)")
    assert res.functions["v"].timeouts == 1 and res.functions["v"].failed_every_call


@pytest.mark.parametrize("verifier", ["401"], indirect=True)
def test_a_401_is_named_and_asked_once_not_retried(verifier, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    t0 = time.monotonic()
    with pytest.raises(VerifierRefused, match=rf"the reward verifier {verifier.url} refused raygrpo's request: HTTP 401"):
        score(verifier.url, http_max_retries=5)
    assert verifier.requests == 1 and time.monotonic() - t0 < 2  # no retry, no backoff


@pytest.mark.parametrize("verifier", ["503"], indirect=True)
@pytest.mark.parametrize("retries", [0, 2])
def test_http_max_retries_is_what_the_server_sees(verifier, retries):
    res = score(verifier.url, http_max_retries=retries)
    assert verifier.requests == retries + 1 and res.errors == 2
    assert "HTTP 503" in res.error_samples[0]
    assert ("after" in res.error_samples[0]) == (retries > 0)


@pytest.mark.parametrize("verifier", [("big", 3 * MB), ("big-chunked", 64 * MB)], indirect=True)
def test_an_over_size_answer_is_an_error_for_its_request_read_no_further_than_the_cap(verifier):
    res = score(verifier.url, http_max_response_mb=1, http_timeout_s=20)
    assert res.errors == 2 and res.functions["v"].failed_every_call and verifier.requests == 1  # not retried
    assert "answered more than 1 MB (reward.http_max_response_mb=1)" in res.error_samples[0]
    if verifier.sent:  # chunked: what the server got out of 64 MB before the client stopped: the cap + socket buffers
        assert verifier.sent < 16 * MB, verifier.sent
    else:  # the Content-Length said it: nothing of the body was read
        assert "Content-Length" in res.error_samples[0]


@pytest.mark.parametrize("verifier", [("big-chunked", 1000)], indirect=True)
def test_an_answer_under_the_cap_is_read_whole(verifier):
    res = score(verifier.url, http_max_response_mb=1)
    assert res.errors == 0 and res.rewards == [1.0, 1.0]


def test_the_cap_is_checked_at_start():
    with pytest.raises(ValueError, match="reward.http_max_response_mb must be > 0, got 0"):
        RewardScorer(RewardConfig(functions=["http://127.0.0.1:9/v"], http_max_response_mb=0))
