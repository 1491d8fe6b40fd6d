"""actors/multiturn/envs.py: the environment contract, the calculator, and the isolated pool (real processes)."""
from __future__ import annotations

import textwrap
import time

import pytest

from actors.multiturn.env_pool import EnvPool
from actors.multiturn.envs import CalculatorEnv, check_step, env_spec_problems, safe_eval

ENV_FILE = textwrap.dedent('''
    import os, time

    class Echo:
        """Counts its steps; its behaviour is chosen by the example's `mode` field."""
        def __init__(self, mode="ok", **_):
            self.mode, self.n = mode, 0

        def reset(self):
            return [{"role": "system", "content": "be brief"}] if self.mode == "greet" else None

        def step(self, text):
            self.n += 1
            if self.mode == "raise":
                raise RuntimeError("boom")
            if self.mode == "hang":
                time.sleep(60)
            if self.mode == "garbage":
                return {"messages": "not a list", "done": "yes"}
            if self.mode == "die":
                os._exit(3)
            return {"messages": [{"role": "user", "content": f"{text}#{self.n}"}], "done": self.n >= 3,
                    "reward": 0.5}
''')


@pytest.fixture
def env_file(tmp_path):
    path = tmp_path / "echo_env.py"
    path.write_text(ENV_FILE)
    return f"{path}:Echo"


def test_calculator_env():
    env = CalculatorEnv(answer="4")
    assert env.reset() is None
    out = env.step("I will use calc(2 + 3*4) now")
    assert out == {"messages": [{"role": "tool", "content": "14"}], "done": False}
    assert env.step("The answer is 14.") == {"messages": [], "done": True}
    assert safe_eval("7/2") == "3.5" and safe_eval("1/0") == "error: division by zero"
    assert safe_eval("__import__('os')").startswith("error") and safe_eval("2**999").startswith("error")


def test_contract_checks_and_spec_problems(tmp_path):
    assert check_step({"messages": [], "done": True}) == {"messages": [], "done": True, "reward": 0.0}
    for bad in ({"done": 1}, {"messages": [{"role": "bot", "content": "x"}], "done": False},
                {"messages": [], "done": True, "reward": float("nan")}, {"messages": [], "done": True, "x": 1}, 7):
        with pytest.raises(TypeError):
            check_step(bad)
    assert env_spec_problems("calculator") == [] and env_spec_problems("") == []
    assert "neither a built-in" in env_spec_problems("nope")[0]
    assert "not found" in env_spec_problems(str(tmp_path / "missing.py") + ":Env")[0]


def test_pool_runs_and_isolates_failures(env_file):
    pool = EnvPool(env_file, num_procs=2, timeout_s=2.0)
    try:
        modes = ["ok", "greet", "raise", "hang", "garbage", "ok"]
        opened = pool.run([(k, "open", {"mode": m}) for k, m in enumerate(modes)])
        assert all(ok for ok, _ in opened)
        assert opened[1][1] == [{"role": "system", "content": "be brief"}] and opened[0][1] == []
        t0 = time.monotonic()
        stepped = pool.run([(k, "step", f"t{k}") for k in range(len(modes))])
        assert time.monotonic() - t0 < 30  # the hang is cut at the timeout
        ok = {k: r for k, r in enumerate(stepped)}
        assert ok[0] == (True, {"messages": [{"role": "user", "content": "t0#1"}], "done": False, "reward": 0.5})
        assert ok[2][0] is False and "boom" in ok[2][1]
        assert ok[3][0] is False and "timed out" in ok[3][1]
        assert ok[4][0] is False and "done='yes'" in ok[4][1]
        assert ok[1][0] and ok[5][0]
        # The hang's process was replaced; the healthy environments kept their state (rebuilt by replay there):
        again = pool.run([(k, "step", "x") for k in (0, 1, 5)])
        assert [r[1]["messages"][0]["content"] for r in again] == ["x#2", "x#2", "x#2"]
        assert pool.replaced == 1
        # A failed environment stays failed; closing forgets every key.
        assert pool.run([(2, "step", "y")])[0][0] is False
        assert all(ok for ok, _ in pool.run([(k, "close", None) for k in range(len(modes))]))
        assert pool.slot == {} and pool.history == {}
    finally:
        pool.close()


def test_a_call_that_kills_its_process_fails_the_calls_beside_it_only(env_file):
    """Calls of one process run at once, so a process that dies takes its calls in flight with it;
    its other environments are rebuilt in the new process."""
    pool = EnvPool(env_file, num_procs=2, timeout_s=5.0)
    try:
        pool.run([(k, "open", {"mode": m}) for k, m in enumerate(["hang", "ok", "die", "ok"])])  # slots 0, 1, 0, 1
        pool.run([(1, "step", "a")])  # key 1 has a state to rebuild
        t0 = time.monotonic()
        stepped = pool.run([(k, "step", "b") for k in (0, 2)])  # both in process 0: the hang is in flight
        assert time.monotonic() - t0 < 4.0  # ended by the death, not by the 5 s deadline
        assert all(ok is False and "died (exit code 3)" in err for ok, err in stepped)
        assert pool.run([(k, "step", "c") for k in (1, 3)]) == [
            (True, {"messages": [{"role": "user", "content": "c#2"}], "done": False, "reward": 0.5}),
            (True, {"messages": [{"role": "user", "content": "c#1"}], "done": False, "reward": 0.5})]
        assert pool.replaced == 1
    finally:
        pool.close()


def test_hanging_calls_time_out_together_and_say_so_while_waiting(env_file):
    """Eight hanging steps on two processes with a 1 s deadline each: the batch takes about one deadline
    (not eight), and the pool prints what it waits on while it waits."""
    lines = []
    pool = EnvPool(env_file, num_procs=2, timeout_s=1.0, progress_every_s=0.3, log=lines.append)
    try:
        pool.run([(k, "open", {"mode": "hang"}) for k in range(8)])
        t0 = time.monotonic()
        stepped = pool.run([(k, "step", "x") for k in range(8)])
        took = time.monotonic() - t0
        assert all(ok is False and "step timed out after 1s" in err for ok, err in stepped)
        assert took < 4.0, took  # one after another it was 8 x 1 s plus 8 process restarts
        assert lines and "waited" in lines[0] and "step call(s)" in lines[0] and "of 8 done" in lines[0], lines
        assert any("8 timed out" in line for line in lines) or "timed out" in lines[-1]
        assert pool.replaced == 2  # each process once, after its calls passed their deadline
    finally:
        pool.close()


def test_pool_refuses_a_class_that_does_not_load(tmp_path):
    path = tmp_path / "bad_env.py"
    path.write_text("class Env:\n    pass\n")
    with pytest.raises(ValueError, match="no method reset"):
        EnvPool(f"{path}:Env", num_procs=1, timeout_s=1.0)


@pytest.mark.timeout(120)
def test_a_batch_bigger_than_the_pipe_does_not_deadlock():
    """400 conversations close at once (the tools demo's evaluation): the answers outgrow the pipe's
    buffer while the pool is still sending. The process must keep reading while its answers wait for
    the pool, or both sides block on a full pipe for good."""
    pool = EnvPool("calculator", num_procs=1, timeout_s=30.0)
    try:
        keys = [f"trajectory-{i:05d}" for i in range(3000)]
        assert all(ok for ok, _ in pool.run([(k, "open", {}) for k in keys]))
        assert all(ok for ok, _ in pool.run([(k, "close", None) for k in keys]))
    finally:
        pool.close()
