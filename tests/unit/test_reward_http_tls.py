"""https:// verifiers against a real TLS server on 127.0.0.1 whose certificate an internal CA signed (made
here, as a company's CA is: it is in no system store): trusted through reward.http_ca_file; without it, or
with a certificate for another host, the run stops at once naming the URL and the setting (no retries:
none changes a certificate); a plain-HTTP server at an https:// URL is said to be one; a CA file that is
missing or not PEM fails at start naming the key. Mutual TLS: a verifier that requires a client certificate
scores with reward.http_client_cert (and reward.http_client_key); one it refuses stops the run naming the
setting; none at all is retried, its error naming the setting."""
from __future__ import annotations

import json
import ssl
import threading

import pytest
from local_http import LocalServer, QuietHandler, example_verifier

from actors.completions import Completion
from actors.config import RewardConfig
from actors.rewards import http
from actors.rewards.http import HttpVerifier, VerifierRefused
from actors.rewards.scorer import RewardScorer

make_pki = pytest.importorskip("tls_certs", reason="the `cryptography` package makes the test's CA and certificates").make_pki
serialization = pytest.importorskip("cryptography.hazmat.primitives.serialization")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """An internal CA (ca.pem), and server certificates it signed: for 127.0.0.1 (good) or another host (other)."""
    return make_pki(tmp_path_factory.mktemp("pki"))


class TlsVerifier:
    """A verifier on 127.0.0.1 serving https with `cert`: 1.0 for every sample; counts the requests it read."""

    def __init__(self, pki, cert: str, client_ca: bool = False, tls: ssl.TLSVersion | None = None):
        self.posts, self.lock = 0, threading.Lock()
        outer = self

        class Handler(QuietHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.posts += 1
                self.send(200, json.dumps({"rewards": [1.0] * len(body["completions"])}))

        self.local = LocalServer(Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(pki / f"{cert}.pem", pki / f"{cert}.key")
        if client_ca:  # mutual TLS: a client certificate the test's CA signed is required
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(pki / "ca.pem")
        if tls is not None:
            context.maximum_version = tls
        self.local.httpd.socket = context.wrap_socket(self.local.httpd.socket, server_side=True)
        self.url = self.local.base.replace("http://", "https://") + "/verify"

    def close(self):
        self.local.close()


@pytest.fixture
def verifier(pki, request):
    v = TlsVerifier(pki, request.param)
    yield v
    v.close()


def _score(url, n=4, **cfg):
    cfg = RewardConfig(functions=[url], **{"http_timeout_s": 5.0, "http_max_retries": 2, **cfg})
    comps = [Completion([7, 1], [-0.1, -0.2], f"{i}+1={i + 1}", "stop") for i in range(n)]
    with RewardScorer(cfg) as scorer:
        return scorer.score([f"{i}+1=" for i in range(n)], comps, [{"answer": str(i + 1)} for i in range(n)],
                            group_size=n)


@pytest.mark.parametrize("verifier", ["good"], indirect=True)
def test_a_verifier_signed_by_the_ca_in_http_ca_file_scores(verifier, pki):
    res = _score(verifier.url, http_ca_file=str(pki / "ca.pem"))
    assert res.rewards == [1.0] * 4 and res.errors == 0 and verifier.posts == 1


@pytest.mark.parametrize("verifier", ["good"], indirect=True)
def test_an_untrusted_certificate_stops_the_run_at_once_naming_the_url_and_the_setting(verifier, monkeypatch):
    backoffs = []
    monkeypatch.setattr(http.time, "sleep", backoffs.append)  # a retry would wait first
    with pytest.raises(VerifierRefused) as e:
        _score(verifier.url)
    msg = str(e.value)
    assert f"the reward verifier {verifier.url} cannot be trusted" in msg
    assert "against the system's CA certificates (unable to get local issuer certificate)" in msg, msg
    assert "Set reward.http_ca_file to the PEM file of the CA that signed it" in msg
    assert verifier.posts == 0  # nothing was sent to a server that could not be trusted
    assert backoffs == []  # asked once: no retry changes a certificate


@pytest.mark.parametrize("verifier", ["other"], indirect=True)
def test_a_certificate_for_another_host_stops_the_run_naming_the_ca_file_used(verifier, pki):
    ca = str(pki / "ca.pem")
    with pytest.raises(VerifierRefused) as e:
        _score(verifier.url, http_ca_file=ca)
    msg = str(e.value)
    assert f"against the CA certificates in reward.http_ca_file={ca!r} (IP address mismatch" in msg
    assert "the URL's host must be one of the names or addresses in the certificate" in msg and verifier.posts == 0


def test_a_plain_http_server_at_an_https_url_is_said_to_be_one():
    class Handler(QuietHandler):
        def do_POST(self):  # noqa: N802
            self.send(200, "{}")

    plain = LocalServer(Handler)
    try:
        url = plain.base.replace("http://", "https://") + "/verify"
        with pytest.raises(VerifierRefused, match=rf"the reward verifier {url} does not answer TLS .*: the server at "
                                                  r"that port speaks plain HTTP; use http:// in reward.functions"):
            _score(url)
    finally:
        plain.close()


def test_a_missing_or_non_pem_ca_file_fails_at_start_naming_the_key(tmp_path):
    url = "https://127.0.0.1:9/verify"
    with pytest.raises(ValueError, match=r"reward.http_ca_file='nope.pem': no such file \(cwd .*\); give the PEM file"):
        RewardScorer(RewardConfig(functions=[url], http_ca_file="nope.pem"))
    junk = tmp_path / "ca.txt"
    junk.write_text("not a certificate\n")
    with pytest.raises(ValueError, match=rf"reward.http_ca_file='{junk}': not a PEM file of CA certificates"):
        RewardScorer(RewardConfig(functions=[url], http_ca_file=str(junk)))


@pytest.fixture
def mtls_verifier(pki):
    """A verifier that requires a client certificate the test's CA signed. TLS 1.2: the server judges the
    client's certificate inside the handshake, so its alert always reaches the client. (Under TLS 1.3 it
    judges it after the handshake, and the client may read its alert or only the closed connection: both
    are handled, the alert as below, the close as the test without a certificate shows.)"""
    v = TlsVerifier(pki, "good", client_ca=True, tls=ssl.TLSVersion.TLSv1_2)
    yield v
    v.close()


def test_a_verifier_that_requires_a_client_certificate_scores_with_http_client_cert(mtls_verifier, pki, tmp_path):
    """Mutual TLS: the certificate and its key in two files, or in one."""
    ca = str(pki / "ca.pem")
    res = _score(mtls_verifier.url, http_ca_file=ca, http_client_cert=str(pki / "client.pem"),
                 http_client_key=str(pki / "client.key"))
    assert res.rewards == [1.0] * 4 and res.errors == 0 and mtls_verifier.posts == 1
    both = tmp_path / "client-and-key.pem"
    both.write_bytes((pki / "client.pem").read_bytes() + (pki / "client.key").read_bytes())
    res = _score(mtls_verifier.url, http_ca_file=ca, http_client_cert=str(both))
    assert res.rewards == [1.0] * 4 and res.errors == 0 and mtls_verifier.posts == 2


def test_a_client_certificate_the_verifier_does_not_trust_stops_the_run_naming_the_setting(mtls_verifier, pki,
                                                                                           monkeypatch):
    backoffs = []
    monkeypatch.setattr(http.time, "sleep", backoffs.append)
    cert = str(pki / "stranger.pem")
    with pytest.raises(VerifierRefused) as e:
        _score(mtls_verifier.url, http_ca_file=str(pki / "ca.pem"), http_client_cert=cert,
               http_client_key=str(pki / "stranger.key"))
    msg = str(e.value)
    assert f"the reward verifier {mtls_verifier.url} refused raygrpo's TLS connection (" in msg, msg
    assert f"raygrpo presented reward.http_client_cert={cert!r}" in msg and "signed by a CA it trusts" in msg
    assert mtls_verifier.posts == 0 and backoffs == []  # asked once: no retry changes a certificate


def test_no_client_certificate_for_a_verifier_that_requires_one_is_retried_then_names_the_setting(mtls_verifier, pki,
                                                                                                  monkeypatch):
    """The server ends the handshake with a bare handshake failure (or, under TLS 1.3, may just close it): that
    looks like other mismatches and dropped connections, so it is retried as one, and the error counted for the
    samples says what to set."""
    monkeypatch.setattr(http.time, "sleep", lambda s: None)
    res = _score(mtls_verifier.url, n=2, http_ca_file=str(pki / "ca.pem"))
    assert res.errors == 2 and mtls_verifier.posts == 0
    said = " ".join(map(str, res.error_samples))
    assert "the server ended the TLS handshake: if the verifier requires a client certificate, set " \
           "reward.http_client_cert" in said, said
    assert "(after 3 attempts)" in said, said


def test_a_client_certificate_that_is_missing_or_not_pem_fails_at_start_naming_the_key(pki, tmp_path):
    url = "https://127.0.0.1:9/verify"
    with pytest.raises(ValueError, match=r"reward.http_client_cert='nope.pem': no such file \(cwd .*\)"):
        RewardScorer(RewardConfig(functions=[url], http_client_cert="nope.pem"))
    with pytest.raises(ValueError, match=r"reward.http_client_key='nope.key': no such file"):
        RewardScorer(RewardConfig(functions=[url], http_client_cert=str(pki / "client.pem"), http_client_key="nope.key"))
    with pytest.raises(ValueError, match=r"not a PEM client certificate with its private key"):
        RewardScorer(RewardConfig(functions=[url], http_client_cert=str(pki / "client.pem")))  # no key anywhere
    locked = tmp_path / "locked.key"  # an encrypted key: refused, never a password prompt on the terminal
    locked.write_bytes(serialization.load_pem_private_key((pki / "client.key").read_bytes(), None).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(b"pw")))
    with pytest.raises(ValueError, match=r"not a PEM client certificate with its private key .*its unencrypted key"):
        RewardScorer(RewardConfig(functions=[url], http_client_cert=str(pki / "client.pem"), http_client_key=str(locked)))
    assert "reward.http_client_key is set" in " ".join(RewardConfig(http_client_key="k.pem").problems())


def test_the_example_server_serves_https_with_cert_and_key(pki):
    """examples/verifier_server.py --cert/--key, as a user starts it: trusted through reward.http_ca_file."""
    with example_verifier("--cert", str(pki / "good.pem"), "--key", str(pki / "good.key")) as url:
        assert url.startswith("https://127.0.0.1:")
        verifier = HttpVerifier(url, RewardConfig(http_ca_file=str(pki / "ca.pem")))
        [outcome] = verifier.collect(verifier.start([{"prompts": ["1+1="], "completions": ["2"], "answer": ["2"]}]))
        assert outcome.results == [(True, 1.0)]
        untrusted = HttpVerifier(url, RewardConfig())  # the system's CA certificates do not know this CA
        with pytest.raises(VerifierRefused, match="cannot be trusted"):
            untrusted.collect(untrusted.start([{"prompts": ["p"], "completions": ["c"]}]))


def test_the_example_server_requires_a_client_certificate_with_client_ca(pki):
    """examples/verifier_server.py --client-ca, as a user starts it: a run with reward.http_client_cert scores."""
    with example_verifier("--cert", str(pki / "good.pem"), "--key", str(pki / "good.key"),
                          "--client-ca", str(pki / "ca.pem")) as url:
        verifier = HttpVerifier(url, RewardConfig(http_ca_file=str(pki / "ca.pem"),
                                                  http_client_cert=str(pki / "client.pem"),
                                                  http_client_key=str(pki / "client.key")))
        [outcome] = verifier.collect(verifier.start([{"prompts": ["1+1="], "completions": ["2"], "answer": ["2"]}]))
        assert outcome.results == [(True, 1.0)]
