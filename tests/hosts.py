"""Hosts with their own addresses on one machine, for the multi-node tests (and the bench's cross-host part).

A "switch" network namespace holds a bridge; each host is a network namespace joined to it by a veth
pair (`eth0` inside the host, an address 10.77.N.i/24 on it, `lo` up). Every command a host runs goes
through `ip netns exec NS unshare --uts --mount sh -c 'hostname NAME; mount -t tmpfs tmpfs /dev/shm; ...'`:
its own hostname and its own /dev/shm (so shared memory does not cross hosts, as on two machines), and
optionally a directory of its own mounted over a path (a host that sees another run dir).

Root and `ip netns` are needed; `unavailable()` says why not, for a skip. Names carry the test process's
pid and a random tag, so a leftover of an earlier run never collides. Every process of a host is stopped
by pid (`ip netns pids`), never by name; `destroy()` deletes the namespaces, and is safe to call twice.

    with two_hosts() as (a, b):          # or Hosts(["a", "b"]) ... destroy()
        head = a.popen(["ray", "start", ...])
        b.kill_all()                     # lose host b: SIGKILL every process it holds
        b.link_down(); b.link_up()       # a partition: its cable pulled, then put back
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from actors.runtime.start_ledger import RAY_CLUSTER, record_start
from cluster.launch.ray_cluster import NODE_START_ENV

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]


def unavailable() -> str | None:
    """Why hosts cannot be made here (a skip reason), or None when they can."""
    if os.geteuid() != 0:
        return f"two-host tests need root (network namespaces); running as uid {os.geteuid()}"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"two-host tests need `{tool}` (iproute2 / util-linux), not found on PATH"
    probe = f"rgprobe{os.getpid()}{secrets.token_hex(2)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip()[:200]}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")


@dataclass
class Host:
    """One host: a network namespace on the switch, its hostname, its address."""

    name: str  # "a", "b", ...
    hostname: str  # what `hostname` says inside it: host-a, ...
    netns: str
    address: str  # 10.77.N.i
    switch: str  # the switch namespace
    switch_port: str  # the veth end on the switch side (link_down pulls it)
    interface: str = "eth0"
    mounts: dict[str, str] = field(default_factory=dict)  # path -> the directory of this host's own mounted there

    def wrap(self, cmd: list[str]) -> list[str]:
        """`cmd` as this host runs it: in its namespace, with its hostname, its /dev/shm and its mounts."""
        setup = [f"hostname {shlex.quote(self.hostname)}", "mount -t tmpfs tmpfs /dev/shm"]
        setup += [f"mount --bind {shlex.quote(src)} {shlex.quote(dst)}" for dst, src in self.mounts.items()]
        script = " && ".join(setup) + ' && exec "$@"'
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "--mount", "sh", "-c", script, "sh", *cmd]

    def popen(self, cmd: list[str], env: dict | None = None, log=None, **kw) -> subprocess.Popen:
        """Start `cmd` on this host (output to `log`, a file, or to a pipe when None)."""
        return subprocess.Popen(self.wrap(cmd), env=env, cwd=kw.pop("cwd", ROOT),
                                stdout=log if log is not None else subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, **kw)

    def run(self, cmd: list[str], env: dict | None = None, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
        """Run `cmd` on this host to the end; stdout and stderr captured."""
        return subprocess.run(self.wrap(cmd), env=env, cwd=kw.pop("cwd", ROOT), capture_output=True, text=True,
                              timeout=timeout, **kw)

    def pids(self) -> list[int]:
        """Every process this host holds now (`ip netns pids`)."""
        out = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True)
        return [int(x) for x in out.stdout.split()]

    def kill_all(self, sig: int = signal.SIGKILL) -> list[int]:
        """Send `sig` to every process of this host, by pid; returns the pids."""
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pids

    def stop_all(self, grace_s: float = 5.0) -> None:
        """SIGTERM every process of this host, then SIGKILL what is left after `grace_s`."""
        stop_together([self], grace_s)

    def link_down(self) -> None:
        """Pull this host's cable: its switch port goes down (no packet in or out; its processes live on)."""
        _ip("-n", self.switch, "link", "set", self.switch_port, "down")

    def link_up(self) -> None:
        _ip("-n", self.switch, "link", "set", self.switch_port, "up")

    def quick_tcp_resend(self, max_ms: int = 1000) -> bool:
        """TCP on this host resends an unanswered segment at least every `max_ms` (net.ipv4.tcp_rto_max_ms, per
        network namespace, Linux 6.15+; 120 s by default), so that after a partition heals a connection goes on
        within `max_ms`, not at its next backed-off resend (the gap doubles at each resend: one sent 25 s into
        a partition waits until ~51 s). tcp_retries2 goes to its maximum, 255, so that a connection to a silent
        peer is still kept ~4 minutes (the kernel's note: a lower tcp_rto_max_ms alone shortens that timeout).
        Set before the host's processes start (a socket reads it when made). False where the kernel has no such
        setting: the test is then only slower."""
        out = subprocess.run(["ip", "netns", "exec", self.netns, "sysctl", "-q", "-w", f"net.ipv4.tcp_rto_max_ms={max_ms}",
                              "net.ipv4.tcp_retries2=255"], capture_output=True, text=True)
        return out.returncode == 0


def stop_together(hosts: list[Host], grace_s: float) -> None:
    """SIGTERM every process of every host in `hosts`, then SIGKILL what is left after `grace_s`."""
    for h in hosts:
        h.kill_all(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(h.pids() for h in hosts) and time.monotonic() < deadline:
        time.sleep(0.2)
    for _ in range(20):  # processes forked while we killed: until none is left
        if not [pid for h in hosts for pid in h.kill_all(signal.SIGKILL)]:
            break
        time.sleep(0.2)


class Hosts:
    """`names` hosts on one private bridge (10.77.N.0/24, N from the pid). `mounts`: host name ->
    {path: its own directory mounted over that path, on that host only}."""

    def __init__(self, names=("a", "b"), mounts: dict[str, dict[str, str]] | None = None):
        tag = f"rg{os.getpid() % 100000}{secrets.token_hex(2)}"
        self.switch = f"{tag}-sw"
        subnet = 1 + os.getpid() % 250
        self.hosts = [Host(name=n, hostname=f"host-{n}", netns=f"{tag}-{n}", address=f"10.77.{subnet}.{i + 1}",
                           switch=self.switch, switch_port=f"p{i}", mounts=dict((mounts or {}).get(n, {})))
                      for i, n in enumerate(names)]
        self._made: list[str] = []
        self._dirs: list[str] = []

    def temp_dir(self, prefix: str) -> str:
        """A short directory for a Ray node's sessions (Ray's socket paths under it have a length limit),
        removed by destroy() once every process that wrote there is gone."""
        d = tempfile.mkdtemp(prefix=prefix)
        self._dirs.append(d)
        return d

    def create(self) -> list[Host]:
        try:
            _ip("netns", "add", self.switch)
            self._made.append(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for h in self.hosts:
                _ip("netns", "add", h.netns)
                self._made.append(h.netns)
                _ip("-n", self.switch, "link", "add", h.switch_port, "type", "veth",
                    "peer", "name", h.interface, "netns", h.netns)
                _ip("-n", self.switch, "link", "set", h.switch_port, "master", "br0")
                _ip("-n", self.switch, "link", "set", h.switch_port, "up")
                _ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", h.interface)
                _ip("-n", h.netns, "link", "set", h.interface, "up")
                _ip("-n", h.netns, "link", "set", "lo", "up")
        except BaseException:
            self.destroy()
            raise
        return self.hosts

    def destroy(self) -> None:
        """Stop every process of every host (by pid), then delete the namespaces. The hosts get their SIGTERM
        together and share one grace period: one after the other, each Ray node's slow exit was waited out
        in turn (3 s a host)."""
        made = [h for h in self.hosts if h.netns in self._made]
        with contextlib.suppress(Exception):
            stop_together(made, grace_s=3.0)
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()
        for d in self._dirs:
            shutil.rmtree(d, ignore_errors=True)
        self._dirs.clear()


@contextlib.contextmanager
def two_hosts(mounts: dict[str, dict[str, str]] | None = None):
    hosts = Hosts(("a", "b"), mounts)
    try:
        yield hosts.create()
    finally:
        hosts.destroy()


# ---------------------------------------------------------------- Ray on the hosts, as a user starts it

# A user's environment: no RAY_* variable, the venv not on PATH (its `ray` is called by path). The head
# then runs with token authentication if ~/.ray/auth_token exists when it starts (Ray 2.60; any earlier
# ray.init on the machine writes one), and without it on a fresh machine.
USER_ENV = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
USER_ENV["PATH"] = os.pathsep.join(p for p in USER_ENV.get("PATH", "/usr/bin:/bin").split(os.pathsep)
                                   if p and Path(p).resolve() != BIN.resolve())
GCS_PORT, DASHBOARD_PORT = 6379, 8265  # Ray's defaults: every host has its own ports


def ray_start(host: Host, args: list[str], temp_dir: str, log, env: dict, attempts: int = 3) -> None:
    """`ray start` on `host` (its own --temp-dir: the hosts share this machine's /tmp), as a user runs it:
    the command returns once the node is up, its processes stay in the host's namespace (stopped by
    pid with the host). Not `--block`: that stops the whole node when one helper (the Ray Client
    server) dies, which a loaded machine makes happen. A start that fails (Ray's own 30 s raylet
    registration, missed under load) is tried again after the host's processes are stopped."""
    cmd = [str(BIN / "ray"), "start", f"--temp-dir={temp_dir}", "--disable-usage-stats",
           f"--node-ip-address={host.address}", *args]
    for attempt in range(1, attempts + 1):
        rc = host.popen(cmd, env={**env, **NODE_START_ENV}, log=log).wait(timeout=600)
        if rc == 0:
            return
        log.write(f"\n[hosts] ray start on {host.hostname} exited {rc} (attempt {attempt} of {attempts})\n")
        log.flush()
        host.stop_all()
    raise RuntimeError(f"ray start on {host.hostname} failed {attempts} times; see {getattr(log, 'name', 'the log')}")


# Ray's GCS marks a node dead after health_check_failure_threshold (5) failed health checks,
# health_check_period_ms apart: 3 s by default, so a host killed outright was said 13.5-17 s after the kill
# (test_lost_host, 2026-11-29). A test that loses hosts on purpose, to test what raygrpo does once Ray says so,
# may start its head checking every second: a killed raylet refuses at once, so its 5 failed checks take ~5 s, while a
# check of a live but busy node still waits health_check_timeout_ms (10 s, unchanged) before it counts as failed.
QUICK_NODE_DEATH_ENV = {"RAY_health_check_period_ms": "1000"}


def ray_head(host: Host, temp_dir: str, log, num_cpus: int = 3, ray_env: dict[str, str] | None = None) -> None:
    """`ray_env`: Ray settings for the head's processes (its GCS), e.g. QUICK_NODE_DEATH_ENV."""
    ray_start(host, ["--head", f"--port={GCS_PORT}", f"--dashboard-host={host.address}",
                     f"--dashboard-port={DASHBOARD_PORT}", "--include-dashboard=true", f"--num-cpus={num_cpus}"],
              temp_dir, log, {**USER_ENV, **(ray_env or {})})
    record_start(RAY_CLUSTER, how=f"ray start --head on {host.hostname}")  # the suite's cost file


def ray_worker(host: Host, head: Host, temp_dir: str, log, num_cpus: int = 3) -> None:
    ray_start(host, [f"--address={head.address}:{GCS_PORT}", f"--num-cpus={num_cpus}"], temp_dir, log,
              joining_env(USER_ENV, head_auth_mode(host, head)))


def joining_env(env: dict, head_mode: str | None) -> dict:
    """The environment of a node joining a head that runs `head_mode`: RAY_AUTH_MODE=token for a token
    head (Ray 2.60 switches token mode on by itself only on a head and in ray.init; its docs: "configured
    consistently on every node"), nothing added otherwise: a joining node in token mode with no token
    fails ("Token authentication is enabled but no authentication token was found"), as on a fresh
    machine whose head started before any ray.init wrote ~/.ray/auth_token."""
    return {**env, "RAY_AUTH_MODE": "token"} if head_mode == "token" else dict(env)


def head_auth_mode(host: Host, head: Host) -> str | None:
    """The mode the head runs, 'token' or 'disabled', asked from `host` (cluster/launch/auth.py)."""
    probe = f"from cluster.launch.auth import gcs_auth_mode; print(gcs_auth_mode('{head.address}:{GCS_PORT}'))"
    out = host.run([sys.executable, "-c", probe], env=USER_ENV, timeout=120)
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else None


def dashboard(head: Host) -> str:
    return f"http://{head.address}:{DASHBOARD_PORT}"


def state_probe(address: str, check: str) -> str:
    """A `python -c` program that runs `check` against Ray's state API at the dashboard `address` (bound to
    `a`; list_nodes, list_actors, list_placement_groups and sys imported), in the cluster's auth mode."""
    return ("import sys; from cluster.launch.auth import dashboard_auth_mode, use_cluster_auth_mode; "
            f"use_cluster_auth_mode(dashboard_auth_mode('{address}'), '{address}'); "
            "from ray.util.state import list_actors, list_nodes, list_placement_groups; "
            f"a = '{address}'; {check}")


def wait_for_nodes(host: Host, head: Host, n: int, timeout_s: float = 300) -> None:
    """Until `n` Ray nodes are alive, asked from `host` through the head's dashboard."""
    address = dashboard(head)
    probe = state_probe(address, f"sys.exit(0 if len(list_nodes(address=a, filters=[('state', '=', 'ALIVE')])) >= {n} else 1)")
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if host.run([sys.executable, "-c", probe], env=USER_ENV, timeout=120).returncode == 0:
            return
        time.sleep(3)
    raise TimeoutError(f"{n} Ray nodes did not come up at {address} within {timeout_s}s")


def wait_until_quiet(host: Host, head: Host, timeout_s: float = 120) -> None:
    """Until the head's cluster is as a fresh one: its node alone alive, no actor alive, no placement group
    kept (a finished run's are removed by Ray after its driver exits; a stopped node is said dead by the
    head), asked from `host` through the head's dashboard. For tests that share one head: the next run
    then finds the room and the nodes the last one started with."""
    address = dashboard(head)
    # Listed whole and filtered here: Ray's state API refuses a node list filtered by state once a node is dead
    # ("Failed to retrieve all 4 nodes ... due to data truncation": it counts the filtered out as truncated)
    probe = state_probe(address, "busy = (sum(n.state == 'ALIVE' for n in list_nodes(address=a, limit=10000)) != 1, "
                                 "[x.class_name for x in list_actors(address=a, limit=10000) if x.state != 'DEAD'], "
                                 "[g.placement_group_id for g in list_placement_groups(address=a, limit=10000) "
                                 "if g.state != 'REMOVED']); print(busy); sys.exit(1 if any(busy) else 0)")
    deadline = time.time() + timeout_s
    while True:
        out = host.run([sys.executable, "-c", probe], env=USER_ENV, timeout=120)
        if out.returncode == 0:
            return
        if time.time() > deadline:
            raise TimeoutError(f"the cluster at {address} still busy after {timeout_s}s: {out.stdout[-2000:]}"
                               f"{out.stderr[-2000:]}")
        time.sleep(1)


def main(argv: list[str]) -> int:
    """`python tests/hosts.py -- CMD ...`: two hosts, a Ray head on host a and a worker node on host b,
    then CMD run on host a ({head} in it: the head's GCS address; {dashboard}: its dashboard URL);
    everything stopped and deleted after. E.g. the bench's cross-host part:
    python tests/hosts.py -- .venv/bin/raygrpo bench --parts crosshost 'ray.address={head}'"""
    if "--" not in argv or not argv[argv.index("--") + 1:]:
        print(main.__doc__, file=sys.stderr)
        return 2
    cmd = argv[argv.index("--") + 1:]
    why = unavailable()
    if why:
        print(f"hosts: {why}", file=sys.stderr)
        return 2
    tmp = tempfile.mkdtemp(prefix="rg-hosts-")  # kept: the nodes' log and Ray's session dirs
    with two_hosts() as (a, b), open(Path(tmp) / "ray_nodes.log", "w") as log:
        print(f"hosts: the Ray nodes' output goes to {tmp}/ray_nodes.log", flush=True)
        ray_head(a, f"{tmp}/a", log)
        wait_for_nodes(a, a, 1, timeout_s=600)
        ray_worker(b, a, f"{tmp}/b", log)
        wait_for_nodes(a, a, 2, timeout_s=600)
        print(f"hosts: {a.hostname} {a.address} (Ray head), {b.hostname} {b.address} (worker node)", flush=True)
        cmd = [c.replace("{head}", f"{a.address}:{GCS_PORT}").replace("{dashboard}", dashboard(a)) for c in cmd]
        return subprocess.run(a.wrap(cmd), cwd=ROOT, env=USER_ENV).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
