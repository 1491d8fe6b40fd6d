"""Code rewards' sandbox (reward.code_sandbox=strict, actors/runtime/sandbox/): hostile programs score 0 with
their outcome named, the run is unharmed, nothing of theirs is left running, the listener is never reached
and no file outside the sandbox is read or touched. Each case is a program whose test passes only if its
attack worked, so a 0 is the attack failing. Sessions and CI run as root, where every namespace is there;
a machine without them is refused (the last tests)."""
from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from actors.config import RewardConfig
from actors.rewards import code as code_kind
from actors.rewards.scorer import RewardScorer
from actors.runtime.sandbox import LEVELS, probe
from actors.runtime.sandbox.runner import HARNESS_SOURCE, MAX_PROCESSES

PROJECT = Path(__file__).resolve().parents[2]
DAEMON_MARK = "987.654"  # the daemon's `sleep` argument: how its process would be found on the host
NO_STRICT = probe("strict")  # why the strict level cannot be had here (None: it can)
pytestmark = pytest.mark.skipif(NO_STRICT is not None, reason=f"no strict sandbox here: {NO_STRICT}")


class Listener:
    """A TCP server on every address of this host, counting the connections it accepts."""

    def __init__(self):
        self.sock = socket.create_server(("0.0.0.0", 0))
        self.port, self.accepted = self.sock.getsockname()[1], 0
        self.sock.settimeout(0.2)
        self.running = True
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while self.running:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self):
        self.running = False
        self.thread.join()
        self.sock.close()


def host_address() -> str:
    """This host's own address (not loopback): the interface a packet out of the sandbox would leave by."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: only the route's source address is read
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _descends_from_this_test(pid: int) -> bool:
    me = os.getpid()
    while pid > 1:
        pid = _parent(pid)
        if pid == me:
            return True
    return False


def sandbox_processes() -> list[int]:
    """Processes left of this module's sandboxes: the daemon's `sleep` (its argument is this module's alone),
    anywhere on the host; a sandbox's harness or the program's forks (the harness's source is on their command
    line) started by this test process (other pytest workers' sandboxes may be running meanwhile)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if DAEMON_MARK in cmdline or (HARNESS_SOURCE[:60] in cmdline and _descends_from_this_test(int(pid))):
            found.append(int(pid))
    return found


@pytest.fixture(scope="module")
def scorer():
    with RewardScorer(RewardConfig(functions=["code_tests"], code_timeout_s=2.0, code_memory_mb=256,
                                   code_max_output_kb=64)) as s:
        yield s


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """A run dir and a home-dir file holding a secret, a listener, and a secret in the driver's environment."""
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "secret.txt").write_text("run-secret")
    home_file = Path.home() / f".raygrpo-sandbox-test-{uuid.uuid4().hex}"
    home_file.write_text("home-secret")
    listener = Listener()
    secret = "env-secret-" + uuid.uuid4().hex
    # /proc/PID/environ shows what a process was started with: a process started with the secret, as a
    # driver is with its RAY_* / WANDB_* / HF_* variables (os.environ set later would not be there to read)
    driver_like = subprocess.Popen(["sleep", "300"], env={**os.environ, "WANDB_API_KEY": secret})
    try:
        yield {"run": run_dir, "home": home_file, "listener": listener, "env": secret}
    finally:
        driver_like.kill()
        driver_like.wait()
        listener.close()
        home_file.unlink()


def score_one(scorer, program: str, test: str = "assert attack()") -> tuple[float, list[dict]]:
    result = scorer.score(["p"], [f"```python\nimport os, socket, subprocess, signal, shutil, sys\n{program}\n```"],
                          [{"test_list": [test]}])
    return result.rewards[0], result.tests[0]


def hostile_cases(p: dict) -> dict[str, tuple[str, set[str]]]:
    """name -> (a program whose attack() returns True only if the attack worked, the outcomes allowed)."""
    port, run, home, here = p["listener"].port, p["run"], p["home"], host_address()
    return {
        "fork bomb": ("def attack():\n    while True:\n        try:\n            os.fork()\n"
                      "        except OSError:\n            pass", {"timeout"}),
        "infinite loop": ("def attack():\n    while True:\n        pass", {"timeout"}),
        "10 GB allocation": ("def attack():\n    return len(bytearray(10 * 2**30)) > 0", {"memory"}),
        "1 GB print": ("def attack():\n    for _ in range(1024):\n        print('x' * 2**20)\n    return True",
                       {"output_limit"}),
        "TCP to 127.0.0.1": (f"def attack():\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                             "    return True", {"error"}),
        "TCP to the host's address": (f"def attack():\n    socket.create_connection(({here!r}, {port}), timeout=1)\n"
                                      "    return True", {"error"}),
        "os.system a network tool": (f"def attack():\n    return os.system('curl -s -m 1 http://127.0.0.1:{port}/ "
                                     f"|| wget -q -T 1 http://{here}:{port}/') == 0", {"failed"}),
        "subprocess a network tool": (f"def attack():\n    return subprocess.run(['curl', '-s', '-m', '1', "
                                      f"'http://{here}:{port}/']).returncode == 0", {"failed"}),
        "read the run dir": (f"def attack():\n    return open({str(run / 'secret.txt')!r}).read() == 'run-secret'",
                             {"error"}),
        "read the home dir": (f"def attack():\n    return open({str(home)!r}).read() == 'home-secret'", {"error"}),
        "read the project": (f"def attack():\n    return len(open({str(PROJECT / 'pyproject.toml')!r}).read()) > 0",
                             {"error"}),
        "the driver's environment through /proc": (
            "def attack():\n    seen = str(os.environ)\n    for pid in os.listdir('/proc'):\n        try:\n"
            "            seen += open(f'/proc/{pid}/environ').read()\n        except OSError:\n            pass\n"
            f"    return {p['env']!r} in seen", {"failed"}),
        "write outside the temp dir": (
            "def attack():\n    done = 0\n"
            f"    for path in [{str(run / 'pwned')!r}, {str(PROJECT / 'pwned')!r}, '/usr/pwned', '/pwned']:\n"
            "        try:\n            open(path, 'w').write('x')\n            done += 1\n        except OSError:\n"
            "            pass\n    return done > 0", {"failed"}),
        "kill the parent": ("def attack():\n    os.kill(os.getppid(), signal.SIGKILL)\n"
                            "    os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)\n    time.sleep(0.5)\n"
                            "    return False\nimport time", {"failed", "error"}),
        "a daemon that double-forks and sleeps": (
            "def attack():\n    if os.fork() == 0:\n        os.setsid()\n        if os.fork() == 0:\n"
            f"            os.execv('/bin/sleep', ['sleep', {DAEMON_MARK!r}])\n        os._exit(0)\n"
            "    time.sleep(0.3)\n    return False\nimport time", {"failed"}),
        "close stdout": ("def attack():\n    os.close(1)\n    os.close(2)\n    print('gone')\n    return False",
                         {"failed", "error"}),
        "delete its own temp dir": ("def attack():\n    shutil.rmtree(os.getcwd(), ignore_errors=True)\n"
                                    "    return not os.path.exists(os.getcwd())", {"failed"}),
    }


CASES = ["fork bomb", "infinite loop", "10 GB allocation", "1 GB print", "TCP to 127.0.0.1",
         "TCP to the host's address", "os.system a network tool", "subprocess a network tool", "read the run dir",
         "read the home dir", "read the project", "the driver's environment through /proc",
         "write outside the temp dir", "kill the parent", "a daemon that double-forks and sleeps", "close stdout",
         "delete its own temp dir"]


@pytest.mark.parametrize("case", CASES)
def test_a_hostile_program_scores_0_with_its_outcome_and_harms_nothing(scorer, places, case):
    program, outcomes = hostile_cases(places)[case]
    files_before = sorted(os.listdir(places["run"])), sorted(os.listdir(PROJECT))
    reward, tests = score_one(scorer, program)
    assert reward == 0.0, tests
    assert tests[0]["outcome"] in outcomes, tests
    assert places["listener"].accepted == 0
    assert (sorted(os.listdir(places["run"])), sorted(os.listdir(PROJECT))) == files_before
    assert not Path("/usr/pwned").exists() and not Path("/pwned").exists()
    assert places["home"].read_text() == "home-secret"
    assert sandbox_processes() == [], "a process of the program outlived its score"
    # the run unharmed: the same scorer scores a right program next
    assert score_one(scorer, "def attack():\n    return True")[0] == 1.0


def test_the_attacks_work_outside_the_sandbox(places):
    """The hostile cases are real: unsandboxed (the process level, as this test's user), the listener is
    reached and the files are read, so the strict level's 0s above are its doing."""
    with RewardScorer(RewardConfig(functions=["code_tests"], code_sandbox="process", code_timeout_s=5.0)) as weak:
        for case in ("TCP to 127.0.0.1", "read the run dir", "read the home dir", "the driver's environment through /proc"):
            reward, tests = score_one(weak, hostile_cases(places)[case][0])
            assert reward == 1.0, (case, tests)
    assert places["listener"].accepted >= 1
    places["listener"].accepted = 0


def test_a_fork_bomb_is_held_by_the_process_limit_not_only_by_the_clock(scorer):
    """RLIMIT_NPROC holds inside the sandbox: the host's root is exempt from it, so when the driver is root
    the program runs as nobody (strict.py); its forks stop near MAX_PROCESSES instead of filling the host."""
    program = ("def attack():\n    n = 0\n    while n < 500:\n        try:\n            pid = os.fork()\n"
               "        except OSError:\n            break\n        if pid == 0:\n            time.sleep(60)\n"
               "            os._exit(0)\n        n += 1\n    assert False, n\nimport time")
    reward, tests = score_one(scorer, program)
    forks = int(tests[0]["detail"].rpartition(" ")[2])
    assert reward == 0.0 and 0 < forks < MAX_PROCESSES, tests
    assert sandbox_processes() == []


def test_a_forged_verdict_on_stdout_or_the_exit_code_is_not_a_pass(scorer):
    """The score is the harness's channel with its nonce: printing what a verdict looks like, and exiting
    0 before the test ran, pass nothing."""
    program = ("print('{\"nonce\": \"x\", \"tests\": [{\"outcome\": \"passed\", \"detail\": \"\"}]}')\n"
               "sys.stdout.flush()\nos._exit(0)")
    reward, tests = score_one(scorer, program, "assert False")
    assert reward == 0.0 and tests[0]["outcome"] == "error", tests
    assert "exited with code 0" in tests[0]["detail"]


def test_a_level_the_machine_lacks_is_refused_at_start_with_the_reason(monkeypatch):
    reason = "unshare: unshare failed: Operation not permitted"
    monkeypatch.setattr(code_kind, "probe", lambda level: reason if level == "strict" else None)
    with pytest.raises(ValueError) as refused:
        RewardScorer(RewardConfig(functions=["code_tests"]))
    text = str(refused.value)
    assert reason in text and "reward.code_sandbox=strict cannot be had" in text
    assert "reward.code_sandbox=process" in text and "weaker" in text
    with RewardScorer(RewardConfig(functions=["code_tests"], code_sandbox="process")) as weaker:  # asked for: runs
        assert weaker.score(["p"], ["def f(): return 1"], [{"test_list": ["assert f() == 1"]}]).rewards == [1.0]


def test_the_probe_names_a_missing_tool(monkeypatch):
    monkeypatch.setattr(LEVELS["strict"], "missing", lambda: "unshare not found on PATH (util-linux)")
    assert probe("strict") == "unshare not found on PATH (util-linux)"


def test_nothing_of_a_timed_out_program_is_left_when_its_sandbox_is_killed(scorer):
    """A program past its time (and its harness's own deadline) is killed with its whole namespace."""
    t0 = time.monotonic()
    reward, tests = score_one(scorer, "def attack():\n    while True:\n        pass", "assert attack()\nassert 1")
    assert reward == 0.0 and tests[0]["outcome"] == "timeout"
    assert time.monotonic() - t0 < 2.0 + 5.0
    assert sandbox_processes() == []
