"""The verifier kind of `reward.functions` entry: `http://HOST[:PORT]/PATH` (or https://), a remote
verifier; its metric name is the URL's host and path.

The protocol (README, "Remote verifiers"): raygrpo POSTs a JSON object

    {"prompts": [...], "completions": [...], "<column>": [...], ...}

with at most `reward.http_max_batch` samples: exactly the keywords a TRL-style Python function
receives (completions are text for string prompts and `[{"role": "assistant", "content": text}]`
for conversational ones; every dataset column, `completion_ids`, and raygrpo's `_num_tokens`,
`_finish_reason`, ... as lists), and reads back `{"rewards": [float | null, ...]}`, one per
sample, null meaning "cannot score this one" (left out of its group, never scored as 0).

- `reward.http_concurrency` requests are in flight at once; each waits `reward.http_timeout_s`.
- Connection errors, 5xx and 429 are retried `reward.http_max_retries` times with exponential
  backoff (0.5 s, 1 s, 2 s, ... at most 8 s; a Retry-After header is honoured up to 30 s).
- A request with no answer in time is an error for its samples (counted), not retried.
- An answer larger than `reward.http_max_response_mb` is an error for its samples, not retried: it
  is read no further than that + 1 byte (a Content-Length over it is refused before reading).
- 401 / 403 (credentials) and 404 / 405 (no verifier at that path) stop the run at once, naming
  the URL; any other 4xx is an error for that request's samples, not retried.
- `Authorization: Bearer $RAYGRPO_REWARD_TOKEN` is sent when that variable is set (read by the
  driver at start).

- https:// certificates are verified against the system's CA certificates, or against
  `reward.http_ca_file` (PEM) when it is set; a certificate that fails, or a server that does not
  speak TLS at an https:// URL, stops the run at once, naming the URL and that setting (a retry
  cannot change either).
- A verifier that requires a client certificate (mutual TLS) gets `reward.http_client_cert` (PEM, with
  its key in `reward.http_client_key` or in the same file). One it refuses stops the run at once,
  naming the URL and that setting; a server that ends the handshake without saying why (what some do
  when no certificate, or one they do not accept, is sent) is retried, its error saying so.

Standard library only (urllib honours http_proxy / no_proxy); runs in the driver, on threads:
HTTP is I/O, there is no user code to isolate.
"""
from __future__ import annotations

import json
import math
import numbers
import os
import ssl
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from http.client import HTTPException
from urllib.parse import urlsplit

from actors.config import RewardConfig
from actors.rewards.base import Batch, KindRunner, RewardKind, Tally, columns, safe_name, trl_completion

TOKEN_ENV = "RAYGRPO_REWARD_TOKEN"
MAX_BACKOFF_S, MAX_RETRY_AFTER_S = 8.0, 30.0


class HttpKind(RewardKind):
    name = "http"
    form = "a verifier URL 'http(s)://...'"

    def recognises(self, spec: str) -> bool:
        return spec.startswith(("http://", "https://"))

    def default_name(self, spec: str, loaded: dict[str, str]) -> str:
        u = urlsplit(spec)
        return safe_name(f"{u.hostname or ''}{u.path.rstrip('/')}")

    def problems(self, spec: str) -> list[str]:
        u = urlsplit(spec)
        if not u.hostname:
            return [f"reward verifier URL {spec!r} has no host (expected http://HOST[:PORT]/PATH)"]
        try:
            u.port  # noqa: B018 - raises on a bad port
        except ValueError as e:
            return [f"reward verifier URL {spec!r}: {e}"]
        return []

    def timeout_setting(self, spec: str, cfg: RewardConfig) -> str | None:
        return f"reward.http_timeout_s={cfg.http_timeout_s:g}"

    def start(self, specs: list[str], cfg: RewardConfig) -> HttpVerifiers:
        return HttpVerifiers(specs, cfg)


class HttpVerifiers(KindRunner):
    """One HttpVerifier per URL; a batch's requests are sent at once, collected by `wait`."""

    def __init__(self, specs: list[str], cfg: RewardConfig):
        self.cfg = cfg
        self.verifiers = {s: HttpVerifier(s, cfg) for s in specs}

    def send(self, specs: list[str], batch: Batch, tally: Tally, progress):
        pending = {s: self._start(s, batch, progress) for s in specs}

        def wait() -> None:
            for spec, futures in pending.items():
                for outcome, (idx, _) in zip(self.verifiers[spec].collect([f for _, f in futures]), futures):
                    tally.stats[spec].calls += 1
                    tally.stats[spec].timeouts += outcome.timed_out
                    for i, (ok, value) in zip(idx, outcome.results):
                        tally.record(spec, i, ok, value)

        return wait

    def _start(self, spec: str, batch: Batch, progress) -> list:
        """Requests of at most reward.http_max_batch samples, sent at once; [(indices, (future, n))]."""
        n, size = len(batch), self.cfg.http_max_batch
        batches = [list(range(s, min(s + size, n))) for s in range(0, n, size)]
        payloads = [{"prompts": [batch.prompts[i] for i in idx],
                     "completions": [trl_completion(batch.prompts[i], batch.texts[i]) for i in idx],
                     **columns(idx, batch.ids, batch.fields)} for idx in batches]
        progress.add(spec, len(payloads))
        futures = self.verifiers[spec].start(payloads)
        for fut, _ in futures:
            fut.add_done_callback(lambda f, spec=spec: progress.finish(
                spec, timed_out=not f.exception() and f.result().timed_out))
        return list(zip(batches, futures))

    def close(self) -> None:
        for verifier in self.verifiers.values():
            verifier.close()


class VerifierRefused(RuntimeError):
    """The verifier refuses every request (credentials, wrong path), or cannot be trusted or reached over TLS
    (its certificate, a server without TLS at an https:// URL): the run cannot go on."""


# What a TLS server answers when it does not accept raygrpo's client certificate (or wanted one and got none):
# OpenSSL's names of those alerts.
CLIENT_CERT_ALERTS = ("TLSV13_ALERT_CERTIFICATE_REQUIRED", "TLSV1_ALERT_UNKNOWN_CA", "SSLV3_ALERT_BAD_CERTIFICATE",
                      "SSLV3_ALERT_CERTIFICATE_UNKNOWN", "SSLV3_ALERT_CERTIFICATE_EXPIRED",
                      "SSLV3_ALERT_CERTIFICATE_REVOKED", "TLSV1_ALERT_ACCESS_DENIED")


def tls_context(ca_file: str, client_cert: str = "", client_key: str = "") -> ssl.SSLContext:
    """What https:// verifiers are checked against: the system's CA certificates, or `ca_file`'s
    (reward.http_ca_file); with `client_cert` (reward.http_client_cert, its key in `client_key` or in the
    same file), the certificate raygrpo presents to a verifier that requires one. A file that is missing or
    not what it should be is a ValueError naming its setting."""
    context = ssl.create_default_context()
    if ca_file:
        where = f"reward.http_ca_file={ca_file!r}"
        if not os.path.isfile(ca_file):
            raise ValueError(f"{where}: no such file (cwd {os.getcwd()}); give the PEM file of the CA that signed "
                             "the verifier's certificate")
        try:
            context = ssl.create_default_context(cafile=ca_file)
        except (ssl.SSLError, OSError, ValueError) as e:
            raise ValueError(f"{where}: not a PEM file of CA certificates ({e}); give the CA that signed the "
                             "verifier's certificate, in PEM ('-----BEGIN CERTIFICATE-----')") from None
    if client_cert:
        where = f"reward.http_client_cert={client_cert!r}" + (f", reward.http_client_key={client_key!r}"
                                                              if client_key else "")
        for setting, path in (("reward.http_client_cert", client_cert), ("reward.http_client_key", client_key)):
            if path and not os.path.isfile(path):
                raise ValueError(f"{setting}={path!r}: no such file (cwd {os.getcwd()}); give the PEM file of the "
                                 "client certificate the verifier accepts, and its private key")
        try:
            # an encrypted key would make OpenSSL prompt on the terminal, which a job has not: refused instead
            context.load_cert_chain(client_cert, client_key or None, password=lambda: b"")
        except (ssl.SSLError, OSError, ValueError) as e:
            raise ValueError(f"{where}: not a PEM client certificate with its private key ({e}); give the "
                             "certificate ('-----BEGIN CERTIFICATE-----') and its unencrypted key, in one file "
                             "or with the key in reward.http_client_key") from None
    return context


class _RequestFailed(Exception):
    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


@dataclass
class RequestOutcome:
    """One request's answer: per sample (True, value | None) or (False, error text)."""

    results: list[tuple[bool, object]]
    timed_out: bool = False
    seconds: float = 0.0
    attempts: int = 1


def _jsonable(value):
    """What json cannot encode itself (numpy values and arrays, sets, bytes) as lists, numbers or text."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def parse_rewards(raw: bytes, n: int, url: str) -> list[tuple[bool, object]]:
    """A verifier's 200 answer -> per sample (True, float | None) or (False, why); raises _RequestFailed
    when the answer as a whole is not `{"rewards": [n values]}`."""
    expected = f'expected {{"rewards": [{n} numbers or null]}}'
    try:
        body = json.loads(raw)
    except ValueError:
        raise _RequestFailed(f"answered with something that is not JSON ({raw[:120]!r}); {expected}") from None
    rewards = body.get("rewards") if isinstance(body, dict) else None
    if not isinstance(rewards, list) or len(rewards) != n:
        got = f"{len(rewards)} rewards" if isinstance(rewards, list) else f"{json.dumps(body)[:120]}"
        raise _RequestFailed(f"answered {got} for {n} samples; {expected}")
    out = []
    for v in rewards:
        if v is None:
            out.append((True, None))
        elif isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            out.append((False, f"{url} returned {v!r:.60} for a sample, not a finite number or null"))
        else:
            out.append((True, float(v)))
    return out


class HttpVerifier:
    """POSTs batches to one verifier URL, `cfg.http_concurrency` at a time."""

    def __init__(self, url: str, cfg, token: str | None = None):
        self.url, self.cfg = url, cfg
        # what an https:// URL's certificate is checked against (a bad reward.http_ca_file fails here, at start)
        self.context = (tls_context(cfg.http_ca_file, cfg.http_client_cert, cfg.http_client_key)
                        if url.startswith("https://") else None)
        self.token = token if token is not None else (os.environ.get(TOKEN_ENV) or None)
        self._executor = ThreadPoolExecutor(cfg.http_concurrency, thread_name_prefix="reward-http")

    def start(self, payloads: list[dict]) -> list[tuple[Future, int]]:
        """Send every payload (one request each, concurrently); `collect` waits for them."""
        return [(self._executor.submit(self._request, p, len(p["prompts"])), len(p["prompts"])) for p in payloads]

    def collect(self, futures: list[tuple[Future, int]], on_done=None) -> list[RequestOutcome]:
        """Each request's outcome, in order. `on_done(outcome)` is called as each one ends.
        Raises VerifierRefused (the run must stop) if the verifier refused a request."""
        # A server that trickles bytes can outlast the per-read timeout: bound each request's whole life.
        bound = (self.cfg.http_max_retries + 1) * (self.cfg.http_timeout_s + MAX_RETRY_AFTER_S)
        deadline, out = time.monotonic() + bound, []
        for fut, n in futures:
            try:
                outcome = fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                outcome = RequestOutcome([(False, f"{self.url}: no complete answer within {bound:.0f} s")] * n,
                                         timed_out=True, seconds=bound)
            out.append(outcome)
            if on_done is not None:
                on_done(outcome)
        return out

    def _request(self, payload: dict, n: int) -> RequestOutcome:
        t0, attempt = time.monotonic(), 0
        body = json.dumps(payload, default=_jsonable).encode()
        headers = {"Content-Type": "application/json", "User-Agent": "raygrpo"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        while True:
            try:
                results = self._post_once(body, headers, n)
                return RequestOutcome(results, seconds=time.monotonic() - t0, attempts=attempt + 1)
            except _RequestFailed as e:
                error, retry, wait = str(e), False, 0.0
                if e.timed_out:
                    return RequestOutcome([(False, f"{self.url}: {error}")] * n, timed_out=True,
                                          seconds=time.monotonic() - t0, attempts=attempt + 1)
            except _Retryable as e:
                error, retry, wait = str(e), True, e.retry_after
            if not retry or attempt >= self.cfg.http_max_retries:
                tries = f" (after {attempt + 1} attempts)" if attempt else ""
                return RequestOutcome([(False, f"{self.url}: {error}{tries}")] * n, seconds=time.monotonic() - t0,
                                      attempts=attempt + 1)
            # By hand, not httpx's HTTPTransport(retries=N) (issue 60): httpcore retries only the connection, and
            # with it the TLS handshake (an untrusted certificate, which stops the run at once here, would be
            # asked N times) and a connect timeout, the first time without a wait; never a 5xx, a 429 or Retry-After.
            time.sleep(max(min(MAX_BACKOFF_S, 0.5 * 2 ** attempt), min(wait, MAX_RETRY_AFTER_S)))
            attempt += 1

    def _post_once(self, body: bytes, headers: dict, n: int) -> list[tuple[bool, object]]:
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        timeout = self.cfg.http_timeout_s
        try:
            with urllib.request.urlopen(request, timeout=timeout, context=self.context) as response:
                raw = _read_capped(response, self.cfg.http_max_response_mb)
        except urllib.error.HTTPError as e:
            detail = _body_text(e)
            self._refused(e, detail)
            if e.code >= 500 or e.code == 429:
                raise _Retryable(f"HTTP {e.code} {e.reason}{detail}", _retry_after(e)) from None
            hint = " (lower reward.http_max_batch)" if e.code == 413 else ""
            raise _RequestFailed(f"HTTP {e.code} {e.reason}{detail}{hint}") from None
        except TimeoutError:
            raise _RequestFailed(f"no answer within {timeout:g} s (reward.http_timeout_s)", timed_out=True) from None
        except urllib.error.URLError as e:
            self._untrusted(e.reason)
            if isinstance(e.reason, TimeoutError):
                raise _RequestFailed(f"no connection within {timeout:g} s (reward.http_timeout_s)", timed_out=True) from None
            raise _Retryable(f"cannot connect: {e.reason}{self._closed_hint(e.reason)}") from None
        except (HTTPException, ConnectionError, OSError) as e:  # the connection broke mid-answer
            self._untrusted(e)  # (under TLS 1.3 a refused client certificate is said after the handshake)
            raise _Retryable(f"connection failed: {type(e).__name__}: {e}{self._closed_hint(e)}") from None
        return parse_rewards(raw, n, self.url)

    def _refused(self, e: urllib.error.HTTPError, detail: str) -> None:
        if e.code in (401, 403):
            token = (f"raygrpo sent the token from ${TOKEN_ENV}" if self.token
                     else f"${TOKEN_ENV} is not set, so raygrpo sent no Authorization header")
            raise VerifierRefused(
                f"the reward verifier {self.url} refused raygrpo's request: HTTP {e.code} {e.reason}{detail}. "
                f"{token}; set {TOKEN_ENV} to the verifier's token (sent as 'Authorization: Bearer <token>')")
        if e.code in (404, 405):
            raise VerifierRefused(f"no reward verifier at {self.url}: HTTP {e.code} {e.reason}{detail}. Check the "
                                  "URL's host, port and path in reward.functions (raygrpo POSTs to it)")

    def _untrusted(self, reason) -> None:
        """TLS failed in a way no retry changes: the certificate, or no TLS at all at an https:// URL."""
        ca = self.cfg.http_ca_file
        against = f"the CA certificates in reward.http_ca_file={ca!r}" if ca else "the system's CA certificates"
        if isinstance(reason, ssl.SSLCertVerificationError):
            raise VerifierRefused(
                f"the reward verifier {self.url} cannot be trusted: its TLS certificate failed verification against "
                f"{against} ({reason.verify_message or reason}). Set reward.http_ca_file to the PEM file of the CA that "
                "signed it (the URL's host must be one of the names or addresses in the certificate)")
        if isinstance(reason, ssl.SSLError) and reason.reason == "WRONG_VERSION_NUMBER":
            raise VerifierRefused(f"the reward verifier {self.url} does not answer TLS ({reason}): the server at "
                                  f"that port speaks plain HTTP; use http:// in reward.functions, or serve it with TLS")
        if isinstance(reason, ssl.SSLError) and reason.reason in CLIENT_CERT_ALERTS:
            cert = self.cfg.http_client_cert
            sent = (f"raygrpo presented reward.http_client_cert={cert!r}" if cert else
                    "reward.http_client_cert is not set, so raygrpo presented no client certificate")
            raise VerifierRefused(
                f"the reward verifier {self.url} refused raygrpo's TLS connection ({reason.reason}): {sent}. A "
                "verifier that requires mutual TLS needs reward.http_client_cert (PEM, with its key in "
                "reward.http_client_key or in the same file) signed by a CA it trusts")

    def _closed_hint(self, reason) -> str:
        """An https:// server that ended the handshake without saying why (closed it, or a bare handshake
        failure): what a verifier requiring a client certificate does when it gets none, or one it does not
        accept; a transient close or another mismatch looks the same, hence retried, with this said."""
        if not (isinstance(reason, ssl.SSLEOFError) or
                isinstance(reason, ssl.SSLError) and reason.reason == "SSLV3_ALERT_HANDSHAKE_FAILURE"):
            return ""
        if self.cfg.http_client_cert:
            return (" (the server ended the TLS handshake: a verifier that does not accept "
                    f"reward.http_client_cert={self.cfg.http_client_cert!r} does this)")
        return " (the server ended the TLS handshake: if the verifier requires a client certificate, set reward.http_client_cert)"

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class _Retryable(Exception):
    def __init__(self, message: str, retry_after: float = 0.0):
        super().__init__(message)
        self.retry_after = retry_after


def _read_capped(response, max_mb: float) -> bytes:
    """The answer's body, at most max_mb MB: a longer one raises _RequestFailed having read cap + 1 bytes."""
    cap = int(max_mb * 1024 * 1024)
    too_big = f"answered more than {max_mb:g} MB (reward.http_max_response_mb={max_mb:g})"
    length = response.headers.get("Content-Length", "")
    if length.strip().isdigit() and int(length) > cap:
        raise _RequestFailed(f"{too_big}: Content-Length {int(length):,} bytes; nothing of it was read")
    chunks, got = [], 0
    while got <= cap:
        chunk = response.read(cap + 1 - got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    if got > cap:
        raise _RequestFailed(f"{too_big}; read no further than {cap + 1:,} bytes")
    return b"".join(chunks)


def _body_text(e: urllib.error.HTTPError) -> str:
    try:
        text = e.read(300).decode("utf-8", "replace").strip()
    except Exception:  # noqa: BLE001 - a body we cannot read adds nothing
        text = ""
    return f" ({text})" if text else ""


def _retry_after(e: urllib.error.HTTPError) -> float:
    try:
        return float(e.headers.get("Retry-After", 0) or 0)
    except (TypeError, ValueError):
        return 0.0
