"""What runs inside the sandbox: a program's tests, each in a forked child, their outcomes written to the
harness's own channel. Standard library only and no project import: this file's source is handed to a bare
interpreter (`python -I -S -c`), in a root where the project is not visible.

    stdin (read once, before any program code runs): {"nonce", "program", "tests", "timeout_s",
        "memory_mb", "output_bytes", "nproc", "nofile", "result_fd", "workdir", "pid_namespace"}
    result_fd (a pipe the runner opened): one line, {"nonce": ..., "tests": [{"outcome", "detail"}, ...]}

Why a program cannot forge its score: it runs in a child forked per test that closes `result_fd` and
overwrites the nonce before the program's first line; the harness is not dumpable (PR_SET_DUMPABLE 0),
so the child cannot read the nonce from /proc/PID/mem or reopen the channel through /proc/PID/fd. Its
stdout, stderr and exit code are read only to cap output and to name how it ended, never as a verdict.

Each child: its own process group; rlimits on address space, CPU seconds, file size, processes and open
files; stdout and stderr go to one pipe the harness drains and cuts at `output_bytes` (output_limit). A
child past the program's remaining time is killed with its group (timeout). In a pid namespace the
harness is its init: after each test it kills every other process there, double-forked daemons included.
"""
import ctypes
import json
import os
import resource
import select
import signal
import sys
import time

PR_SET_DUMPABLE = 4
NOT_RUN = "not run: the program's time ran out on an earlier test"


def _limit(which, value, headroom=0):
    value = int(value)
    soft, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard - headroom)
    resource.setrlimit(which, (value, value + headroom))


def _child(spec, test, report_w, out_w, nonce):
    """Runs in the forked child: drop the harness's secrets, apply the limits, run program + test."""
    for i in range(len(nonce)):
        nonce[i] = 0
    os.close(spec["result_fd"])
    os.setpgid(0, 0)
    os.dup2(out_w, 1)
    os.dup2(out_w, 2)
    os.close(out_w)
    memory = spec["memory_mb"] * 1024 * 1024
    _limit(resource.RLIMIT_AS, memory)
    _limit(resource.RLIMIT_FSIZE, memory)
    _limit(resource.RLIMIT_CPU, spec["timeout_s"] + 1, headroom=1)  # SIGXCPU at the soft limit, SIGKILL a second on
    _limit(resource.RLIMIT_NOFILE, spec["nofile"])
    if spec["nproc"]:
        _limit(resource.RLIMIT_NPROC, spec["nproc"])
    report = os.fdopen(report_w, "w")
    try:
        scope = {"__name__": "__main__", "__builtins__": __builtins__}
        exec(compile(spec["program"], "<program>", "exec"), scope)
        exec(compile(test, "<test>", "exec"), scope)
        verdict = {"outcome": "passed", "detail": ""}
    except MemoryError:
        verdict = {"outcome": "memory", "detail": f"MemoryError past {spec['memory_mb']} MB"}
    except AssertionError as e:
        verdict = {"outcome": "failed", "detail": f"AssertionError: {e}"[:300]}
    except BaseException as e:  # noqa: BLE001 - the program may raise anything, SystemExit included
        outcome = "output_limit" if isinstance(e, OSError) and e.errno == 27 else "error"  # EFBIG
        verdict = {"outcome": outcome, "detail": f"{type(e).__name__}: {e}"[:300]}
    try:
        report.write(json.dumps(verdict))
        report.flush()
    finally:
        os._exit(0)


def _kill_group(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def _kill_namespace():
    """As the pid namespace's init: every other process in it, whatever its group or session. Again until
    none is left, since a fork bomb forks while it is being killed."""
    me = os.getpid()
    for _ in range(100):
        others = [int(n) for n in os.listdir("/proc") if n.isdigit() and int(n) != me]
        for pid in others:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        if not others:
            return


def _ended(status, spec):
    """How a child that wrote no verdict ended."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU:
            return {"outcome": "timeout", "detail": "past its CPU seconds (SIGXCPU)"}
        if sig == signal.SIGXFSZ:
            return {"outcome": "output_limit", "detail": "file size limit"}
        return {"outcome": "error", "detail": f"killed by {signal.Signals(sig).name}"}
    return {"outcome": "error", "detail": f"exited with code {os.WEXITSTATUS(status)} before its test ended"}


def _run_test(spec, test, deadline, nonce):
    report_r, report_w = os.pipe()
    out_r, out_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(report_r)
        os.close(out_r)
        _child(spec, test, report_w, out_w, nonce)
    try:
        os.setpgid(pid, pid)
    except OSError:  # it did so itself already
        pass
    os.close(report_w)
    os.close(out_w)
    verdict, report, out_bytes, status = None, b"", 0, None
    # Until the child ends: a daemon it left may hold both pipes open for ever.
    while status is None:
        left = deadline - time.monotonic()
        if left <= 0:
            verdict = {"outcome": "timeout", "detail": f"past {spec['timeout_s']:g} s (reward.code_timeout_s)"}
            break
        for fd in select.select([report_r, out_r], [], [], min(left, 0.05))[0]:
            chunk = os.read(fd, 65536)
            if fd == report_r:
                report += chunk
            else:
                out_bytes += len(chunk)
        if out_bytes > spec["output_bytes"]:
            verdict = {"outcome": "output_limit", "detail": f"wrote over {spec['output_bytes']} bytes"}
            break
        done, st = os.waitpid(pid, os.WNOHANG)
        status = st if done else None
    if status is not None:  # what it wrote just before it ended
        while select.select([report_r], [], [], 0)[0] and (chunk := os.read(report_r, 65536)):
            report += chunk
    _kill_group(pid)
    if status is None:
        status = os.waitpid(pid, 0)[1]
    os.close(report_r)
    os.close(out_r)
    if verdict is None:
        try:
            verdict = json.loads(report.decode())
        except ValueError:
            verdict = _ended(status, spec)
    if spec["pid_namespace"]:
        _kill_namespace()
    return verdict


def main():
    spec = json.loads(sys.stdin.buffer.read())
    os.close(0)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    nonce = bytearray(spec.pop("nonce").encode())
    os.chdir(spec["workdir"])  # the one writable place
    os.environ["HOME"] = os.environ["TMPDIR"] = spec["workdir"]
    deadline = time.monotonic() + spec["timeout_s"]
    results = []
    for test in spec["tests"]:
        if time.monotonic() >= deadline:
            results.append({"outcome": "timeout", "detail": NOT_RUN})
        else:
            results.append(_run_test(spec, test, deadline, nonce))
    with os.fdopen(spec["result_fd"], "w") as channel:
        channel.write(json.dumps({"nonce": nonce.decode(), "tests": results}) + "\n")


if __name__ == "__main__":
    main()
