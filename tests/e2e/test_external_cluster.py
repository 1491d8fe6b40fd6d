"""A Ray cluster started by hand, exactly as a user does (README, "On a cluster"):

    .venv/bin/ray start --head --node-ip-address 127.0.0.1 --port P --dashboard-host 127.0.0.1 ...
    raygrpo submit my-project/train.yaml --address http://127.0.0.1:D
    raygrpo submit examples/cpu_demo.yaml --address http://127.0.0.1:D model.path=...
    raygrpo train examples/cpu_demo.yaml model.path=... ray.address=127.0.0.1:P
    cd proj && raygrpo train run.yaml learner.num_ranks=2 ray.address=127.0.0.1:P

One train by address trains (a user's own multi-turn project, whose console and completions are also what a
new user reads first); the train of examples/cpu_demo.yaml by address is refused for want of the cluster's
token. One submit trains (a user's own directory, outside the checkout); the submit of a config inside the
checkout is refused by the job itself at its config check, which is all that mode needs of the job
that the training submit does not already show (test_multinode.py trains a checkout submit on two
hosts, where network namespaces can be made).

The head is the venv's `ray` started by its path, with the venv NOT on PATH and no `RAY_*`
variable in the environment of the head, the client or the test (Ray 2.60 then runs the head
with token authentication, the token in ~/.ray/auth_token): the product must find the token and
the cluster's Python by itself. One head serves the module; it is stopped by its own process
group (never `ray stop`, which would stop every Ray on the machine), and every port it uses is
given explicitly so it cannot collide with another Ray here.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml
from console import run

from actors.runtime.sockets import free_ports
from actors.runtime.start_ledger import RAY_CLUSTER, record_start
from actors.runtime.waits import WAITING_LINE_EVERY_S
from cluster.bench.console_lines import classify
from cluster.launch.ray_cluster import NODE_START_ENV
from cluster.models.wordproblems import conversational_rows, write_jsonl
from cluster.run.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the venv's bin: ray, raygrpo
# Ray's own worker servers (every actor process has one, on all interfaces: Ray's, documented in
# docs/DESIGN.md) take ports from this range; our listeners take free ports outside it.
RAY_WORKER_PORTS = range(10002, 20000)


def user_env() -> dict[str, str]:
    """This environment without any RAY_* variable and without the venv on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "/usr/bin:/bin").split(os.pathsep)
                                  if p and Path(p).resolve() != BIN.resolve())
    return env


def tiny_run(model_dir, run_dir, steps: int) -> list[str]:
    """A few short steps of the CPU demo's config with no reference actor (algo.beta=0): what this file tests
    is the cluster, not the KL penalty (tests/e2e/test_train.py has the reference actor)."""
    return [f"model.path={model_dir}", f"trainer.run_dir={run_dir}", f"trainer.steps={steps}",
            "trainer.prompts_per_step=4", "trainer.group_size=4", "data.num_eval=0", "data.task_digits=1",
            "rollout.max_model_len=48", "rollout.max_new_tokens=6", "rollout.gpu_memory_utilization=0.03",
            "metrics.tensorboard=false", "algo.beta=0"]


def train_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip().endswith("}")]
    return [r["step"] for r in rows if r.get("kind") == "train"]


@contextlib.contextmanager
def hand_started_head(ports_given: dict | None = None):
    """`<venv>/bin/ray start --head` on 127.0.0.1 with explicit ports (`ports_given` overrides some);
    yields (gcs, dashboard) addresses once the dashboard answers."""
    gcs, dash, *more = free_ports(9)
    temp_dir = tempfile.mkdtemp(prefix="rg-ext-")  # short: Ray's socket paths have a length limit
    log = open(Path(temp_dir) / "head.log", "w")
    ports = {"--port": gcs, "--dashboard-port": dash, **dict(zip(
        ("--node-manager-port", "--object-manager-port", "--ray-client-server-port", "--dashboard-agent-listen-port",
         "--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port"), more, strict=True)),
             **(ports_given or {})}
    proc = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
         "--num-cpus=4", f"--temp-dir={temp_dir}", f"--min-worker-port={RAY_WORKER_PORTS.start}",
         f"--max-worker-port={RAY_WORKER_PORTS.stop - 1}", "--disable-usage-stats", *[f"{k}={v}" for k, v in ports.items()]],
        env=user_env() | NODE_START_ENV, cwd=temp_dir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 180
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{dash}/api/gcs_healthz", timeout=5).read()
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"ray start --head did not come up: {(Path(temp_dir) / 'head.log').read_text()}") from None
                time.sleep(2)
        record_start(RAY_CLUSTER, how="hand-started head")  # the suite's cost file (tests/suite_costs.py)
        yield f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dash}"
    finally:
        # SIGTERM lets the head drain; then whatever is left of its process group goes
        for sig, wait_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 20)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=wait_s)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        for p in psutil.process_iter(["cmdline"]):  # workers Ray moved out of the group still name the temp dir
            if any(temp_dir in a for a in (p.info["cmdline"] or [])):
                p.kill()
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def head():
    """One hand-started head for the module's tests, with token authentication: where no ray.init has
    written ~/.ray/auth_token yet (a fresh machine), the user's step for a token cluster in Ray's docs
    makes one first (`ray get-auth-token --generate`); the head then switches token mode on by itself."""
    if not (Path.home() / ".ray" / "auth_token").is_file():
        subprocess.run([str(BIN / "ray"), "get-auth-token", "--generate"], env=user_env(), check=True,
                       capture_output=True, timeout=120)
    with hand_started_head() as addresses:
        yield addresses


@pytest.mark.timeout(600)
def test_submit_of_a_config_in_the_checkout_uploads_the_checkout_and_runs_there_on_the_clusters_python(head, tmp_path):
    """`raygrpo submit examples/cpu_demo.yaml` from the checkout: the checkout itself is the job's working
    dir (no code beside it), `sh cluster/job_entry.sh` runs from the job's copy of it on the cluster's
    Python, and the CLI there reads the config from that copy. A relative model.path that names no model
    makes the job's own config check refuse it (no actor starts), naming the path it resolved in the
    job's copy: the training itself is what the user-directory submit below shows."""
    _, dashboard = head
    out = subprocess.run([str(BIN / "raygrpo"), "submit", "examples/cpu_demo.yaml", "--address", dashboard,
                          "model.path=no-such-model", f"trainer.run_dir={tmp_path / 'run'}"],
                         cwd=ROOT, env=user_env(), capture_output=True, text=True, timeout=500)
    print(out.stdout[-5000:], out.stderr[-3000:])
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]  # the job FAILED, not the submit
    assert "submitted job" in out.stdout and "FAILED" in out.stdout
    assert "raygrpo's code beside it" not in out.stdout  # a config in the checkout: the checkout travels whole
    assert f"driver runs on {BIN / 'python'}" in out.stdout  # the cluster's Python, not the first on PATH
    (resolved,) = re.findall(r"model\.path '([^']*)' is not a model directory", out.stdout)
    # examples/cpu_demo.yaml was found (the problem is the model, not the config file) and the job ran
    # in its copy of the checkout: the relative path resolves there, not in this checkout
    assert resolved.endswith("/no-such-model") and not resolved.startswith(str(ROOT)), resolved
    assert not (tmp_path / "run").exists()


def listeners(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket of `pids` and their children."""
    procs = []
    for pid in pids:
        p = psutil.Process(pid)
        procs += [p, *p.children(recursive=True)]
    found = []
    for p in procs:
        try:  # a child can end between the listing and this read (test_embedded_listeners failed so, in CI)
            found += [(p.pid, c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="tcp")
                      if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            continue
    return found


@pytest.mark.timeout(300)
def test_train_by_address_without_the_clusters_token_says_where_to_put_it(head, tiny_model_dir, tmp_path):
    """A user without the cluster's token (another HOME) gets told where to put it. (Its own test, not a
    prelude of the training one below: a behaviour of its own, and that test is among the suite's longest.)"""
    gcs, _ = head
    no_token = subprocess.run([str(BIN / "raygrpo"), "train", "examples/cpu_demo.yaml",
                               *tiny_run(tiny_model_dir, tmp_path / "no-token", 5), f"ray.address={gcs}"],
                              cwd=ROOT, env={**user_env(), "HOME": str(tmp_path)}, capture_output=True, text=True,
                              timeout=300)
    assert no_token.returncode == 2, no_token.stderr[-3000:]
    assert "no token was found" in no_token.stderr and "~/.ray/auth_token" in no_token.stderr, no_token.stderr[-3000:]


# The user's environment of the run by address: answers the first turn with a tool message, then ends the
# episode. Its reward is the same for every trajectory, so no group ever has a learning signal. A held-out row's
# `mode` makes its first step hang (cut at rollout.env_timeout_s) or answer with a 100,000-character tool message
# (more than rollout.max_model_len holds).
LOOKUP_ENV = '''
import time


class Lookup:
    def __init__(self, answer, mode="lookup", **fields):
        self.turns, self.mode = 0, mode

    def reset(self):
        return None

    def step(self, text):
        self.turns += 1
        if self.mode == "hang":
            time.sleep(3600)
        if self.mode == "flood":
            return {"messages": [{"role": "tool", "content": "x" * 100_000}], "done": False}
        if self.turns == 1:
            return {"messages": [{"role": "tool", "content": "lookup: nothing found"}], "done": False, "reward": 0.25}
        return {"messages": [], "done": True}
'''


def held_out(modes: list[str]) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"Tom has {a} apples and gets 2 more. How many?"}],
             "answer": f"#### {a + 2}", "mode": mode} for a, mode in enumerate(modes)]


def lookup_project(root: Path, model_dir: Path) -> Path:
    """A user's project directory outside the checkout: a 2-step multi-turn run whose only reward is the
    environment's (reward.functions: []), halt_after 2 with an entropy floor no model meets (the guard trips at
    step 2, the run's last). Its held-out rows hang or flood in every evaluation (greedy and pass@2:
    env_timeout_s=1 is waited out in each of its batches, together, while a flood answers in milliseconds)."""
    proj = root / "proj"
    proj.mkdir()
    (proj / "lookup_env.py").write_text(LOOKUP_ENV)
    write_jsonl(proj / "train.jsonl", conversational_rows(8, seed=5))
    write_jsonl(proj / "eval.jsonl", held_out(["hang", "flood", "hang", "flood"]))
    (proj / "run.yaml").write_text(f"""
model: {{path: {model_dir}}}
data: {{train: train.jsonl, eval: eval.jsonl, num_eval: 4}}
trainer: {{steps: 2, prompts_per_step: 2, group_size: 2, run_dir: runs/lookup, halt_after: 2, entropy_floor: 100.0,
          eval_pass_k: 2, actor_timeout_s: 600}}
rollout: {{env: "lookup_env.py:Lookup", max_turns: 2, max_new_tokens: 8, max_model_len: 160, cpu_kv_cache_mb: 64,
          gpu_memory_utilization: 0.03, env_timeout_s: 1.0}}
reward: {{functions: []}}
learner: {{lr: 1.0e-4, micro_batch_size: 4}}
metrics: {{tensorboard: false, completions_per_step: 2}}
""")
    return proj


@pytest.mark.timeout(900)
def test_train_joins_by_address_listens_on_the_node_ip_and_a_short_multi_turn_run_reads_well(
        head, tiny_chat_model_dir, tmp_path):
    """`raygrpo train run.yaml learner.num_ranks=2 ray.address=HOST:PORT` from a user's project directory, on the
    hand-started head: every step done. During the run, our own listeners (the learner ranks' rendezvous store,
    the weight-transfer store, gloo) are on the node's address, never on 0.0.0.0. (No engine is killed here: a
    restarted engine is re-synced by rebuilding the transfer group on the same listen address every step's sync
    uses, the same code in every mode and on any cluster; the real restart is test_train.py's async kill, the
    sync schedule's at the seam, tests/unit/test_driver_seam.py. A kill here cost an engine start.)

    The same run is what a TRL or verl user looks at first (issue 25): the console, the completions the model
    wrote, a short run that ends normally, a reward from the environment alone (it was
    test_console_and_completions.py's own run, on a Ray cluster of its own: issue 58, one engine start fewer).
    Its held-out rows' environment hangs or floods (issue 30 case 6: it was test_environment_failures.py's run,
    whose training half, an environment that fails every reset, is now at the driver's seam,
    tests/unit/test_driver_seam_halts.py, and on the engine pool's chat engine, test_multiturn.py).
    What a second run there used to show is asserted on runs that start anyway: the third-party lines back in the
    console with --log-level INFO (test_smollm2.py's ZeRO-2 run), a resumed run saying "resumed from" and
    printing the held-out summary, its 'before' from the first run's step-0 evaluation (test_safety.py's rerun
    after SIGTERM); the console of a run on a cluster raygrpo starts itself: the session's finished run
    (test_progress_and_throughput.py)."""
    gcs, _ = head
    proj = lookup_project(tmp_path, tiny_chat_model_dir)
    run_dir = proj / "runs" / "lookup"
    done: list = []
    train = threading.Thread(target=lambda: done.append(run(
        ["train", "run.yaml", "learner.num_ranks=2", f"ray.address={gcs}"], proj, timeout=800, env=user_env())))
    train.start()
    try:
        deadline = time.time() + 600
        while not train_steps(run_dir):
            assert train.is_alive(), done[0].text[-5000:] if done else "no console"
            assert time.time() < deadline, "no step done in 600 s"
            time.sleep(0.2)
        placement = json.loads((run_dir / "placement.json").read_text())
        pid_of = {p["role"]: p["pid"] for p in placement}
        ours = listeners([pid_of["learner-0"], pid_of["learner-1"], pid_of["rollout-0"]])
        open_to_all = [x for x in ours if x[1] in ("0.0.0.0", "::") and x[2] not in RAY_WORKER_PORTS]
        assert not open_to_all, (open_to_all, ours)
        # rank 0's rendezvous store + weight-transfer store + gloo: on the node IP Ray gave the head
        # (Ray 2.60 turns --node-ip-address 127.0.0.1 into this machine's address), nowhere else
        listen = next(p["listen_address"] for p in placement if p["role"] == "learner-0")
        rank0 = [ip for pid, ip, port in ours if pid == pid_of["learner-0"] and port not in RAY_WORKER_PORTS]
        assert len(rank0) >= 2 and set(rank0) == {listen}, (listen, ours)
    finally:
        train.join(900)
    (out,) = done
    report = out.report("a 2-step multi-turn run by address, its evaluations hanging and flooding")
    console = out.text
    assert out.returncode == 0, console[-5000:]
    assert train_steps(run_dir) == [1, 2], console[-3000:]

    # issue 30 case 6: the evaluations' hangs and floods said when they happen, the hangs cut at the timeout
    # (together, not one after another), never quiet; a flood that does not fit said once per run
    assert "eval @ step 0" in console
    assert "trajectories failed at the evaluation at step 0" in console and "step: step timed out after 1s" in console
    assert console.count("did not fit in rollout.max_model_len=160") == 1, console[-3000:]
    # a waiting line every WAITING_LINE_EVERY_S (25 s); the margin is a loaded machine's: ray.init and the actors'
    # creation printed nothing for up to 29.3 s at load 26-45 (docs/benchmarks.md), so 30 s failed without a bug
    assert out.longest_silence()[0] < WAITING_LINE_EVERY_S + 20, report

    # the console is raygrpo's: no third-party line at the default level, vLLM's per-step INFO in logs/
    lines = classify(console.splitlines(keepends=True))
    assert [line for origin, line in lines if origin == "third-party"] == [], console
    assert "step 2/2" in console and "learner:" in console  # raygrpo's own lines, an actor's included
    worker_logs = "".join(p.read_text() for p in (run_dir / "logs").glob("worker-*.log"))
    assert "Successfully reset prefix cache" in worker_logs and "Successfully reset prefix cache" not in console

    # halts that respect a short run: the zero-variance guard only warns (never a signal), the entropy
    # guard trips at the last step and the run ends as usual
    assert "no learning signal yet" in console and "`raygrpo show " in console and "runs/lookup`" in console
    assert "This was the run's last step, so the run ends normally" in console
    assert (run_dir / "hf_model" / "config.json").is_file()
    assert all((run_dir / f).stat().st_size > 1000 for f in ("reward.png", "kl.png", "step_time.png"))

    # the environment's reward alone; lengths per trajectory and per turn
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2] and all(r["reward_mean"] == 0.25 for r in rows)
    assert all(r["completions/turn_mean_length"] <= r["completions/mean_length"] <= 16 for r in rows)
    assert all(0 <= r["completions/turn_clipped_ratio"] <= 1 for r in rows)

    # the completions, and `raygrpo show` prints a transcript with its roles
    logged = [json.loads(x) for x in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 1, 2, 2]
    assert all(r["rewards"] == {} and r["reward"] == 0.25 and r["advantage"] == 0.0 for r in logged)
    shown = subprocess.run([str(BIN / "raygrpo"), "show", "runs/lookup", "--step", "2", "-n", "1"], cwd=proj,
                           capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr
    assert "step 2, 1 of 2 logged completion(s)" in shown.stdout and "reward 0.250 (environment 0.250)" in shown.stdout
    assert "  [user] " in shown.stdout and "  [assistant] " in shown.stdout and "  [tool] lookup: nothing found" in shown.stdout


# A user's own project, outside the checkout: their config, reward file, environment file and data.
# Each file notes the directory it was loaded from, so the test can tell the job's copy from this one.
USER_ENV = '''
import os

HERE = os.path.dirname(os.path.abspath(__file__))


class AskAgain:
    """Answers the first assistant turn with a user message (which says where this file was loaded
    from), then ends the episode; rewards 0.25 for taking part."""

    def __init__(self, answer, **fields):
        self.answer, self.turns = str(answer), 0

    def reset(self):
        return None

    def step(self, text):
        self.turns += 1
        if self.turns == 1:
            return {"messages": [{"role": "user", "content": f"env loaded from {HERE}: once more?"}], "done": False,
                    "reward": 0.25}
        return {"messages": [], "done": True}
'''
USER_REWARD = '''
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def longer_is_better(prompt, completion, _messages, **fields):
    assert HERE != {original!r}, "loaded from the user's own directory, not the job's copy of it"
    return len(completion) / 100
'''


def user_project(root: Path, model_dir: Path, run_dir: Path) -> Path:
    project = root / "my-project"
    (project / "envs").mkdir(parents=True)
    (project / "envs" / "ask_again.py").write_text(USER_ENV)
    (project / "my_rewards.py").write_text(USER_REWARD.format(original=str(project)))
    (project / "problems.jsonl").write_text("".join(
        json.dumps({"prompt": [{"role": "user", "content": f"Tom has {a} apples and gets {b} more. How many?"}],
                    "answer": str(a + b)}) + "\n" for a in range(1, 4) for b in range(1, 4)))
    (project / "train.yaml").write_text(f"""
model: {{path: {model_dir}}}
data: {{train: problems.jsonl, num_eval: 0}}
trainer: {{steps: 2, prompts_per_step: 2, group_size: 2, run_dir: {run_dir}, actor_timeout_s: 600}}
rollout: {{env: "envs/ask_again.py:AskAgain", max_turns: 2, max_new_tokens: 8, max_model_len: 160, cpu_kv_cache_mb: 64,
          gpu_memory_utilization: 0.03}}
reward: {{functions: ["my_rewards.py:longer_is_better"]}}
learner: {{lr: 1.0e-4, micro_batch_size: 4}}
metrics: {{tensorboard: false}}
""")
    return project


@pytest.mark.timeout(900)
def test_submit_a_users_own_directory_trains_on_the_clusters_python_with_its_reward_and_environment_files(
        head, tiny_chat_model_dir, tmp_path):
    """`raygrpo submit` of a config outside the checkout to the hand-started head: the job's driver runs
    on the cluster's Python and trains every step to SUCCEEDED, exporting hf_model/. The config's
    directory (config, reward file, environment file, data; none of them in the checkout or known to
    the cluster) travels with the job, raygrpo's own code beside it, and the job loads the files from
    its copy. (The one training submit of this module: a config inside the checkout is the test above.)"""
    _, dashboard = head
    run_dir = tmp_path / "run"
    project = user_project(tmp_path, tiny_chat_model_dir, run_dir)
    out = subprocess.run([str(BIN / "raygrpo"), "submit", str(project / "train.yaml"), "--address", dashboard],
                         cwd=tmp_path, env=user_env(), capture_output=True, text=True, timeout=800)
    print(out.stdout[-5000:], out.stderr[-3000:])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "submitted job" in out.stdout and "SUCCEEDED" in out.stdout
    assert f"working dir {project}, raygrpo's code beside it" in out.stdout
    assert f"driver runs on {BIN / 'python'}" in out.stdout  # the cluster's Python, not the first on PATH
    assert train_steps(run_dir) == [1, 2]
    assert (run_dir / "hf_model" / "config.json").exists()
    rows = [json.loads(x) for x in (run_dir / "completions.jsonl").read_text().splitlines()]
    # the job's config names the reward file by its absolute path in the job's copy of the directory
    (spec,) = yaml.safe_load((run_dir / "config.yaml").read_text())["reward"]["functions"]
    assert spec.endswith("my_rewards.py:longer_is_better") and not spec.startswith(str(project)), spec
    (name,) = {k for r in rows for k in r["rewards"]}
    assert name == "longer_is_better", name  # completions.jsonl keys it by its one short name
    assert all(r["rewards"][name] is not None for r in rows)  # the reward file ran
    env_said = [m["content"] for r in rows for m in r["messages"] if m["content"].startswith("env loaded from ")]
    assert env_said and all(f"from {project}:" not in m for m in env_said)  # the environment file's copy ran
    assert all(r["env_reward"] == 0.25 for r in rows if r["turns"] == 2)


@pytest.mark.timeout(600)
def test_submit_waits_for_the_job_agent_then_names_the_likely_causes(tiny_model_dir, tmp_path):
    """Another process holds the port of the head's dashboard agent (as another Ray on the node would):
    Ray answers "No available agent"; submit waits --agent-wait seconds, saying so, then explains."""
    blocker = socket.socket()
    blocker.bind(("0.0.0.0", 0))
    blocker.listen()
    with hand_started_head({"--dashboard-agent-listen-port": blocker.getsockname()[1]}) as (_, dashboard):
        (tmp_path / "c.yaml").write_text(f"model: {{path: {tiny_model_dir}}}\ntrainer: {{run_dir: {tmp_path / 'run'}}}\n")
        out = subprocess.run([str(BIN / "raygrpo"), "submit", str(tmp_path / "c.yaml"), "--address", dashboard,
                              "--agent-wait", "5"], cwd=tmp_path, env=user_env(), capture_output=True, text=True,
                             timeout=300)
    blocker.close()
    print(out.stdout[-3000:], out.stderr[-3000:])
    assert out.returncode == 1, out.stdout + out.stderr
    assert "has no job agent ready yet" in out.stdout and "waiting up to 5 s" in out.stdout
    assert "no job agent to take the job after 5 s" in out.stderr and "--dashboard-agent-listen-port" in out.stderr
    assert "still starting" in out.stderr and "Traceback" not in out.stderr
