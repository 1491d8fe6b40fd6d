"""reward.code_sandbox=process, the weaker level: the harness as a plain process of the driver's user, in
a session and process group of its own, in a private temp dir, with the allow-listed environment and the
same rlimits per test (address space, CPU seconds, file size, open files).

What it does not give (strict.py does): the program sees the host's files with the driver's user's
rights and reaches the network; RLIMIT_NPROC counts every process of the user on the host (so it is the
user's count at start plus the limit, and root is not held by it at all); a process that leaves the
process group (setsid) can outlive its score. For code you trust, or inside a container or VM that is
itself the sandbox.
"""
from __future__ import annotations

import os

from actors.runtime.sandbox.runner import Level, Limits


def _user_processes() -> int:
    uid, count = str(os.getuid()), 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                count += any(line.startswith("Uid:") and line.split()[1] == uid for line in f)
        except OSError:
            pass
    return count


class ProcessLevel(Level):
    name = "process"

    def command(self, harness: list[str], workdir: str, limits: Limits, fds: list[int]) -> list[str]:
        return harness

    def nproc(self, limits: Limits) -> int:
        return 0 if os.getuid() == 0 else _user_processes() + limits.nproc
