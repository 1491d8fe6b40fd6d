"""Run `raygrpo` as a user does (the installed console script, from a directory of the user's) and watch
its console: every line of stdout and stderr with the time it arrived, and the longest silence.

The longest silence is the longest gap between two consecutive lines, counting the start of the
process before the first line and the last line before the exit: what a user sees as "nothing happens".
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

RAYGRPO = str(Path(sys.executable).with_name("raygrpo"))  # the console script `pip install` put beside python


@dataclass
class Console:
    returncode: int
    lines: list[tuple[float, str]] = field(default_factory=list)  # (seconds since start, line)
    seconds: float = 0.0

    @property
    def text(self) -> str:
        return "".join(line for _, line in self.lines)

    def longest_silence(self) -> tuple[float, str]:
        """(seconds, the line that ended the silence, or "<exit>")."""
        marks = [(0.0, "<start>"), *self.lines, (self.seconds, "<exit>")]
        gaps = [(b[0] - a[0], b[1].strip()[:120]) for a, b in zip(marks, marks[1:])]
        return max(gaps)

    def report(self, what: str) -> str:
        gap, after = self.longest_silence()
        line = f"{what}: exit {self.returncode} after {self.seconds:.0f}s; longest silence {gap:.1f}s (before: {after})"
        print(line)  # visible with pytest -rP / -s: the figure STATUS.md reports
        return line


def run(args: list, cwd: Path, timeout: float = 900, wrap: list[str] = (), env: dict | None = None) -> Console:
    """`raygrpo ARGS` in `cwd` (wrapped in `wrap`, e.g. an `unshare` that mounts a full disk first), in `env`
    (default: this process's environment)."""
    env = {k: v for k, v in (os.environ if env is None else env).items() if not k.startswith("PYTEST")}
    t0 = time.monotonic()
    proc = subprocess.Popen([*wrap, RAYGRPO, *map(str, args)], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1, env=env, start_new_session=True)
    out = Console(returncode=-1)

    def read():
        for line in proc.stdout:
            out.lines.append((time.monotonic() - t0, line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:
        # However the wait ends (its timeout, or the test's own pytest timeout raised in it), the command and
        # everything it started go: a driver left running kept its Ray cluster, engines and learner ranks busy
        # for the rest of the suite, and the tests after it timed out in turn (CI at stop 67, load 10)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(10)
    out.returncode, out.seconds = proc.returncode, time.monotonic() - t0
    return out


def full_disk_wrapper(mount_point: Path) -> list[str] | None:
    """A command prefix that runs its command with a full 64 KiB tmpfs mounted at `mount_point` (a private
    mount namespace: nothing outside sees it), or None where this machine cannot make one (no root, no
    user namespaces)."""
    script = (f'mount -t tmpfs -o size=64k tmpfs "{mount_point}" && '
              f'(dd if=/dev/zero of="{mount_point}/filler" bs=4k 2>/dev/null; true) && exec "$@"')
    for base in (["unshare", "-m"], ["unshare", "-rm"]):
        probe = subprocess.run([*base, "sh", "-c", "mount -t tmpfs -o size=4k tmpfs /mnt"], capture_output=True)
        if probe.returncode == 0:
            return [*base, "sh", "-c", script, "sh"]
    return None


def wait_while_running(done, proc: subprocess.Popen, timeout_s: float, failure, poll_s: float = 0.5) -> None:
    """Poll `done()` every `poll_s` while `proc` runs, at most `timeout_s`; where the process ends first or the
    time runs out, fail saying which, with `failure()` (what never happened, the console's tail)."""
    deadline = time.time() + timeout_s
    while not done():
        assert proc.poll() is None, f"the process ended (exit code {proc.poll()}): {failure()}"
        assert time.time() < deadline, f"not within {timeout_s:.0f} s: {failure()}"
        time.sleep(poll_s)
