"""Ray's job submission client with every request bounded, and saying what it waits on.

Ray's JobSubmissionClient calls `requests` without a timeout: an address that accepts connections
and never answers (a wedged dashboard, a proxy, the wrong port of something else) would hold
`raygrpo submit` silently forever. Here every request has a connect timeout (CONNECT_TIMEOUT_S) and a
read timeout (`--agent-wait`, at least Ray's own wait for a job agent), and each call runs while the console says, every
WAITING_LINE_EVERY_S (as the actors' waits do: cluster/launch/waits.py), what it is waiting on.
"""
from __future__ import annotations

import sys
import threading
import time

from cluster.launch.waits import WAITING_LINE_EVERY_S

CONNECT_TIMEOUT_S = 10.0
# Ray's head waits up to this long for a job agent before it answers "No available agent" (ray/dashboard/
# consts.py WAIT_AVAILABLE_AGENT_TIMEOUT): a request must be allowed to outlast it, or a short --agent-wait
# would read a head that is about to answer as one that never does.
RAY_AGENT_ANSWER_S = 10.0


def request_timeout(wait_s: float) -> float:
    """The read timeout of one request to the cluster: --agent-wait, but never shorter than Ray's own wait."""
    return max(wait_s, RAY_AGENT_ANSWER_S + 5.0)
VERSION_404 = "Version check returned 404"  # Ray's words when GET /api/version answers 404


class ClusterUnreachable(ConnectionError):
    """The cluster's address did not answer (in time), or is not a Ray dashboard (the CLI: "error", exit 1)."""


def bounded(fn, what: str, address: str, wait_s: float, say=None, whole_call_bound: bool = True, extra_s: float = 0.0):
    """fn() in a helper thread; every WAITING_LINE_EVERY_S a line says what it waits on; after wait_s
    (plus the connect timeout) a ClusterUnreachable naming the address and `what`. fn's own error is
    raised as it is. (fn's requests carry their own timeouts, so the thread ends too.)
    whole_call_bound False: only fn's requests' own timeouts bound it (an upload that keeps sending
    may take longer than wait_s; a silent cluster still ends it after wait_s of silence). extra_s: what fn
    may spend before its bounded requests (a probe with its own timeout)."""
    say = say or (lambda text: print(text, file=sys.stderr, flush=True))
    result: dict = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            result["error"] = e

    t = threading.Thread(target=run, name=f"raygrpo-submit: {what}", daemon=True)
    t0 = time.monotonic()
    limit = request_timeout(wait_s) + CONNECT_TIMEOUT_S + extra_s if whole_call_bound else float("inf")
    t.start()
    while True:
        t.join(timeout=max(0.0, min(WAITING_LINE_EVERY_S, limit - (time.monotonic() - t0))))
        if not t.is_alive():
            break
        waited = time.monotonic() - t0
        if waited >= limit:
            raise ClusterUnreachable(no_answer(address, what, limit))
        # the bound this wait really has (issue 59: "25s so far, at most 20s" from a wait that ended at 35 s)
        bound = f"at most {limit:.0f}s" if whole_call_bound else f"at most {request_timeout(wait_s):.0f}s of silence"
        say(f"waiting on the Ray cluster at {address} ({what}): {waited:.0f}s so far, {bound}")
    if "error" in result:
        raise translate(result["error"], address, what, wait_s)
    return result["value"]


def no_answer(address: str, what: str, wait_s: float) -> str:
    return (f"the Ray cluster at {address} did not answer within {wait_s:.0f}s ({what}): something accepts "
            "connections there but does not answer. Is it the head's dashboard address (http://HEAD:8265 unless "
            "`ray start --head --dashboard-port` set another)? Is the head overloaded? Raise --agent-wait if it is "
            "just slow")


def translate(e: BaseException, address: str, what: str, wait_s: float) -> BaseException:
    """Ray's and requests' errors of an unreachable address, in words that tell what happened."""
    kinds = {f"{c.__module__}.{c.__name__}" for c in type(e).__mro__}  # requests' errors, without importing it here
    if "requests.exceptions.Timeout" in kinds:
        if "requests.exceptions.ConnectTimeout" in kinds:
            return ClusterUnreachable(f"could not connect to the Ray cluster at {address} within {CONNECT_TIMEOUT_S:.0f}s "
                                      f"({what}): is the host reachable and the head running?")
        return ClusterUnreachable(no_answer(address, what, request_timeout(wait_s)))
    if "status code 413" in str(e):  # a package over the dashboard's request limit (Ray's words, then aiohttp's)
        return ClusterUnreachable(f"the Ray cluster at {address} refused the upload ({what}) as too large (HTTP 413): "
                                  "its dashboard takes at most 100 MiB in one request (Ray's DASHBOARD_CLIENT_MAX_SIZE); "
                                  "leave data and models out of the working dir (.rayignore)")
    if VERSION_404 in str(e):  # Ray blames its own version for any 404; it is rarely that
        return ClusterUnreachable(
            f"{address} answered 404 Not Found to Ray's GET /api/version: no Ray dashboard is serving there (a "
            "different service, a gateway or proxy that does not route /api/ to it, or a path in the address). "
            "Pass the head's dashboard address, e.g. http://HEAD:8265 (`ray status` on the head; the dashboard "
            "needs `ray[default]`)")
    tls = tls_failure(e)
    if tls and address.lower().startswith("https://") and ("WRONG_VERSION_NUMBER" in tls or "wrong version" in tls
                                                          or "record layer" in tls or "packet length" in tls):
        return ClusterUnreachable(f"{address} is an https:// address, but what answers there speaks plain HTTP (the TLS "
                                  f"handshake failed: {tls}). Use http://{address[len('https://'):]}, or put TLS in "
                                  "front of the dashboard")
    if tls:
        return ClusterUnreachable(f"the TLS connection to the Ray cluster at {address} failed ({what}): {tls}")
    if isinstance(e, ConnectionError) and "Failed to connect to Ray" in str(e):
        return ClusterUnreachable(f"nothing answers at {address} ({what}): is the head running, and is this its "
                                  "dashboard address (http://HEAD:8265 unless set otherwise)?")
    return e


def tls_failure(e: BaseException) -> str | None:
    """The TLS error behind `e` (Ray wraps requests' SSLError in its own ConnectionError), in its own words; None if
    there is none."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if any(c.__name__ in ("SSLError", "SSLZeroReturnError") for c in type(e).__mro__):
            return str(e)[:300]
        e = e.__cause__ or e.__context__
    return None


def make_client(address: str, wait_s: float):
    """A JobSubmissionClient for `address` whose requests are bounded (connect CONNECT_TIMEOUT_S, read
    request_timeout(wait_s)). Its constructor asks the cluster for its version: call it under `bounded`."""
    from ray.job_submission import JobSubmissionClient

    class BoundedClient(JobSubmissionClient):
        def _do_request(self, method, endpoint, **kwargs):
            kwargs.setdefault("timeout", (CONNECT_TIMEOUT_S, request_timeout(wait_s)))
            return super()._do_request(method, endpoint, **kwargs)

    return BoundedClient(address)
