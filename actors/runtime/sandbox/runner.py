"""Running one program's tests in a sandbox level (strict.py, process.py): the harness (harness.py) is
started by the level's command, handed the program on stdin, and answers on a pipe this process opened,
with the nonce it was given; the whole sandbox is killed at the wall-clock deadline.

A score comes only from that pipe's line carrying the run's nonce: the program's exit code and output are
never read as a verdict. No answer (the sandbox died, or was killed at the deadline) makes every test
whose verdict is missing an `error` (or `timeout`), never a pass.
"""
from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HARNESS_SOURCE = (Path(__file__).parent / "harness.py").read_text()
OUTCOMES = ("passed", "failed", "error", "timeout", "memory", "output_limit")
# Beyond the program's own time: the sandbox's start (namespaces, mounts, the interpreter) and the harness's end.
START_GRACE_S = 5.0
MAX_PROCESSES = 64  # RLIMIT_NPROC: a fork bomb stops here (counted per user namespace at the strict level)
MAX_OPEN_FILES = 64  # RLIMIT_NOFILE
# The environment a program sees: this allow-list and nothing of the driver's (no RAY_*, WANDB_*, HF_*, keys).
ENV_ALLOWED = {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}


@dataclass(frozen=True)
class Limits:
    """What one program may use (reward.code_timeout_s, code_memory_mb, code_max_output_kb)."""

    timeout_s: float
    memory_mb: int
    output_bytes: int
    nproc: int = MAX_PROCESSES
    nofile: int = MAX_OPEN_FILES


class Level:
    """One isolation level: how the harness is started, and what that needs of the machine."""

    name = ""
    weaker: str | None = None  # the level that accepts less, named in the refusal ("process")
    pid_namespace = False  # the harness is the init of a pid namespace of its own

    def command(self, harness: list[str], workdir: str, limits: Limits, fds: list[int]) -> list[str]:
        """argv that starts `harness` (the interpreter and its arguments) in this level's isolation; the level
        appends to `fds` what it opened for the command to inherit (the runner closes them once started)."""
        raise NotImplementedError

    def workdir_inside(self, workdir: str) -> str:
        """The program's writable dir as the program sees it."""
        return workdir

    def nproc(self, limits: Limits) -> int:
        """RLIMIT_NPROC for the program (0: not set)."""
        return limits.nproc

    def missing(self) -> str | None:
        """What the machine lacks for this level, found without running anything (None: nothing)."""
        return None


def base_python() -> str:
    """The interpreter itself (a venv's python is a link to it): the sandbox binds its prefix, not the venv."""
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def run_program(level: Level, program: str, tests: list[str], limits: Limits) -> list[dict]:
    """Per test {"outcome": one of OUTCOMES, "detail": str}, in order; nothing of it outlives this call."""
    workdir = tempfile.mkdtemp(prefix="raygrpo-code-")
    result_r, result_w = os.pipe()
    nonce = secrets.token_hex(16)
    spec = {"nonce": nonce, "program": program, "tests": tests, "result_fd": result_w,
            "workdir": level.workdir_inside(workdir), "pid_namespace": level.pid_namespace,
            **asdict(limits), "nproc": level.nproc(limits)}
    fds: list[int] = []
    try:
        argv = level.command([base_python(), "-I", "-S", "-c", HARNESS_SOURCE], workdir, limits, fds)
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                pass_fds=(result_w, *fds), env=dict(ENV_ALLOWED), cwd=workdir, start_new_session=True)
    except BaseException:
        os.close(result_r)
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    finally:
        for fd in (result_w, *fds):
            os.close(fd)
    try:
        _feed(proc, spec)
        answer = _read_answer(result_r, time.monotonic() + limits.timeout_s + START_GRACE_S)
    finally:
        os.close(result_r)
        _end(proc)
        shutil.rmtree(workdir, ignore_errors=True)
    stderr = proc.stderr.read(4000).decode(errors="replace").strip() if proc.stderr else ""
    proc.stderr and proc.stderr.close()
    return _verdicts(answer, nonce, len(tests), limits, stderr)


def _feed(proc: subprocess.Popen, spec: dict) -> None:
    try:
        proc.stdin.write(json.dumps(spec).encode())
        proc.stdin.close()
    except OSError:  # the sandbox failed to start: its stderr says why
        pass


def _read_answer(fd: int, deadline: float) -> bytes | None:
    """The channel's whole text, or None when the deadline passed first."""
    data = b""
    while (left := deadline - time.monotonic()) > 0:
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return data
            data += chunk
    return None


def _end(proc: subprocess.Popen) -> None:
    """Kill the sandbox's whole process group (at the strict level, unshare takes its namespace down with it)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    proc.wait()


def _verdicts(answer: bytes | None, nonce: str, n: int, limits: Limits, stderr: str) -> list[dict]:
    if answer is None:
        return [{"outcome": "timeout", "detail": f"the sandbox ran past {limits.timeout_s:g} s + "
                 f"{START_GRACE_S:g} s and was killed"}] * n
    try:
        got = json.loads(answer.decode())
        ok = got["nonce"] == nonce and len(got["tests"]) == n and all(t["outcome"] in OUTCOMES for t in got["tests"])
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        why = f": {stderr[-300:]}" if stderr else ""
        return [{"outcome": "error", "detail": f"the sandbox gave no verdict{why}"}] * n
    return [{"outcome": t["outcome"], "detail": str(t.get("detail", ""))} for t in got["tests"]]
