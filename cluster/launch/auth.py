"""Token authentication towards an existing Ray cluster, decided before we connect.

Ray 2.60 turns token authentication on for a cluster started with `ray start --head` whenever
a token exists (`ray.init()` writes one to ~/.ray/auth_token), but a client only sends the
token in token mode, which Ray switches on by itself only for `ray.init(address="auto")` and
only from a `RAY_AUTH_MODE` read when `ray` is imported. A client in the wrong mode fails both
ways: no token towards a token cluster ("Authentication token is missing or incorrect"), and
a token-mode driver on a cluster without tokens has its actors cancelled. So we ask the cluster
which mode it runs (one unauthenticated call), then put this process in that mode through
Ray's own switch (the environment variable plus a re-read of Ray's config, as
`ray._private.authentication.authentication_token_setup._enable_token_auth` does), before any
Ray client is made. An explicit `RAY_AUTH_MODE` always wins.
"""
from __future__ import annotations

import json
import os
import sys
import urllib.request
from pathlib import Path

MODE_VAR = "RAY_AUTH_MODE"
TOKEN_HELP = ("put the cluster's token where Ray looks for it: ~/.ray/auth_token (copy it from the head's "
              "~/.ray/auth_token; `ray get-auth-token` on the head prints it), or RAY_AUTH_TOKEN=<token>, or "
              "RAY_AUTH_TOKEN_PATH=<file>")


class ClusterAuthError(RuntimeError):
    """The cluster wants a token we do not have (or rejected ours)."""


def token_file() -> Path:
    """The token file Ray reads: RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token."""
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token").expanduser()


def token_source() -> str | None:
    """Where Ray would read the token from, in Ray's order of precedence, or None."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN"
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if token_file().is_file():
        return path or str(token_file())
    if path:
        raise ClusterAuthError(f"RAY_AUTH_TOKEN_PATH={path} names no readable file; {TOKEN_HELP}")
    return None


def dashboard_auth_mode(url: str, timeout_s: float = 10.0) -> str | None:
    """'token' | 'disabled' from the dashboard's (unauthenticated) /api/authentication_mode; None if unknown."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/api/authentication_mode", timeout=timeout_s) as r:
            return json.loads(r.read()).get("authentication_mode")
    except Exception:  # noqa: BLE001 - an older Ray or a proxy: fall back to "a token if we have one"
        return None


def gcs_auth_mode(address: str, timeout_s: float = 10.0) -> str | None:
    """'token' | 'disabled' for the GCS at HOST:PORT (one token-less RPC); None if it cannot be asked."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return None  # a TLS cluster: leave the handshake to Ray
    with grpc.insecure_channel(address) as channel:
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s)
            return "disabled"
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                return "token"
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise ConnectionError(f"no Ray cluster answers at {address} ({e.code().name}): is the head running, "
                                      "and is HOST:PORT its GCS address (the --port of `ray start --head`)?") from None
            return None


def resolve_gcs_address(address: str) -> str:
    """ray.address as Ray resolves it: "auto" is the cluster this node runs (or RAY_ADDRESS)."""
    if address != "auto":
        return address
    from ray._private.services import canonicalize_bootstrap_address_or_die

    return canonicalize_bootstrap_address_or_die("auto")


def use_cluster_auth_mode(cluster_mode: str | None, cluster: str) -> None:
    """Put this process's Ray clients in `cluster_mode`; a token cluster and no token is a clear error.

    `cluster_mode` None (the cluster could not be asked): token mode if a token is at hand.
    """
    if os.environ.get(MODE_VAR):
        return  # the user chose; Ray reads it
    source = token_source()
    if cluster_mode == "token" and source is None:
        raise ClusterAuthError(f"the Ray cluster at {cluster} uses token authentication and no token was found; "
                               f"{TOKEN_HELP}")
    mode = cluster_mode or ("token" if source else None)
    if mode is None:
        return
    os.environ[MODE_VAR] = mode
    if "ray._raylet" in sys.modules:  # Ray read RAY_AUTH_MODE at import: make it read it again
        from ray._raylet import Config

        Config.initialize("")


def explain_auth_failure(e: BaseException, cluster: str) -> ClusterAuthError | None:
    """A clear error for Ray's authentication failures (None if `e` is something else)."""
    text = f"{type(e).__name__}: {e}"
    if "uthenticat" not in text and "auth token" not in text.lower():
        return None
    source = token_source()
    if source is None:
        return ClusterAuthError(f"the Ray cluster at {cluster} wants an authentication token and none was found; "
                                f"{TOKEN_HELP}")
    return ClusterAuthError(f"the Ray cluster at {cluster} rejected the token from {source} (a token of another "
                            f"cluster?); {TOKEN_HELP}")


def keep_token_private(say=print) -> str | None:
    """The token file Ray reads (RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token) made 0600 where it is ours and others
    may read it: Ray's `ray.init()` writes a new one with the umask's mode (0644 seen, issue 59), and with it
    anyone on the machine could submit code to the cluster. Returns the path changed, or None."""
    path = token_file()
    try:
        st = path.stat()
        if st.st_uid != os.getuid() or not st.st_mode & 0o077:
            return None
        path.chmod(0o600)
    except OSError:
        return None  # none there, or not ours to change
    say(f"Ray's token file {path} was readable by others: now 0600 (only you can read it)", flush=True)
    return str(path)
