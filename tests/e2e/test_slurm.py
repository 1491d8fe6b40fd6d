"""docker/slurm.sbatch run for real (issue 37): a one-host SLURM cluster (Debian's slurm-wlm; slurmctld
and slurmd started here, with a slurm.conf written for this host), the script submitted with `sbatch`
as a user submits it, training the tiny model for 2 steps on the Ray head it starts; then the run's
metrics. Skipped, with the reason, where SLURM is not installed or its daemons cannot start
(`apt-get install -y slurm-wlm`; slurmd runs as root). Real SLURM, Ray, vLLM, DeepSpeed.

One SLURM node: a second node on the same host would need a second slurmd and a second Ray node
with ports of its own (the workers' branch of the script is the head's `ray start` with
`--address`, in token mode; tests/e2e/test_multinode.py joins a worker node that way)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from actors.runtime.sockets import free_port
from cluster.run.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
DAEMONS = ("slurmctld", "slurmd", "sbatch", "scontrol", "sinfo")


def slurm_conf(d: Path, host: str) -> str:
    # auth/none: no munge daemon to run; config_overrides: the node offers 8 CPUs on a 2-core machine
    # (Ray's actors take fractions of them, as in the embedded cluster)
    return f"""ClusterName=raygrpotest
SlurmctldHost={host}
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
NodeName={host} NodeAddr=127.0.0.1 CPUs=8 RealMemory=16000 State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)


def stop_ray_of(temp_dir: str) -> None:
    """The Ray processes of the job's head (their command lines carry its temp dir), by pid."""
    procs = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if any(temp_dir in part for part in p.info["cmdline"] or ()) and p.pid != os.getpid():
            procs.append(p)
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=20)


@pytest.fixture
def slurm_cluster():
    missing = [d for d in DAEMONS if not shutil.which(d) and not Path(f"/usr/sbin/{d}").exists()]
    if missing:
        pytest.skip(f"SLURM is not installed here ({', '.join(missing)} missing): apt-get install -y slurm-wlm")
    if os.geteuid() != 0:
        pytest.skip("slurmd runs jobs as their users and must start as root; this test is not root")
    d = Path(tempfile.mkdtemp(prefix="rgs-"))  # short: Ray's socket paths under it have a length limit
    (d / "state").mkdir()
    (d / "spool").mkdir()
    host = socket.gethostname().split(".")[0]
    conf = d / "slurm.conf"
    conf.write_text(slurm_conf(d, host))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    sbin = {name: shutil.which(name) or f"/usr/sbin/{name}" for name in ("slurmctld", "slurmd")}
    daemons = [subprocess.Popen([sbin["slurmctld"], "-D", "-i", "-f", str(conf)], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.STDOUT, start_new_session=True)]
    daemons.append(subprocess.Popen([sbin["slurmd"], "-D", "-f", str(conf), "-N", host], env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True))
    try:
        deadline = time.time() + 120
        while True:
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout.strip()
            if state.startswith("idle"):
                break
            dead = [p.args[0] for p in daemons if p.poll() is not None]
            if dead or time.time() > deadline:
                logs = "\n".join(f"{f.name}: {f.read_text()[-1500:]}" for f in d.glob("*.log"))
                pytest.skip(f"the SLURM daemons did not start here ({dead or 'node state ' + repr(state)}):\n{logs}")
            time.sleep(2)
        yield d, env
    finally:
        for p in reversed(daemons):
            stop(p)
        stop_ray_of(str(d))
        shutil.rmtree(d, ignore_errors=True)


def test_the_sbatch_file_trains_on_the_ray_cluster_it_starts(slurm_cluster, tiny_model_dir):
    d, env = slurm_cluster
    run_dir = d / "run"
    ports = {"--dashboard-port": free_port(), "--dashboard-agent-listen-port": free_port(),
             "--dashboard-agent-grpc-port": free_port(), "--metrics-export-port": free_port(),
             "--runtime-env-agent-port": free_port(), "--ray-client-server-port": free_port(),
             "--node-manager-port": free_port(), "--object-manager-port": free_port()}
    # Another Ray on this host (other tests, other users) holds Ray's default ports: the site's knob for it.
    env = {k: v for k, v in env.items() if not k.startswith(("RAY_", "WANDB_"))}
    env |= {"RAYGRPO_RAY_PORT": str(free_port()), "RAYGRPO_NODE_WAIT_S": "300",
            "RAYGRPO_RAY_START_ARGS": " ".join(f"{k}={v}" for k, v in ports.items()) + f" --temp-dir={d}/ray"}
    submit = subprocess.run(
        ["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", "--cpus-per-task=8", "--time=30",
         f"--output={d}/job.out", f"--chdir={ROOT}", f"--export=ALL,RAYGRPO_VENV={Path(sys.executable).parents[1]}",
         "docker/slurm.sbatch", "examples/cpu_demo.yaml", f"model.path={tiny_model_dir}", f"trainer.run_dir={run_dir}",
         "trainer.steps=2", "trainer.prompts_per_step=2", "trainer.group_size=2", "trainer.eval_every=0",
         "trainer.eval_pass_k=1", "data.num_eval=2", "data.task_digits=1", "trainer.dynamic_sampling=false",
         "checkpoint.every=0", "rollout.max_new_tokens=4", "rollout.gpu_memory_utilization=0.03",
         "learner.micro_batch_size=4", "metrics.tensorboard=false"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.strip().split(";")[0]
    t0, state = time.time(), ""
    deadline = t0 + 900
    try:
        while time.time() < deadline:
            info = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
            state = next((w.split("=", 1)[1] for w in info.split() if w.startswith("JobState=")), "")
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                break
            time.sleep(5)
    finally:
        if state not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            subprocess.run(["scancel", job], env=env, check=False)
    out = (d / "job.out").read_text() if (d / "job.out").is_file() else "(no job output)"
    assert state == "COMPLETED", f"job {job}: {state or 'no state'} after {time.time() - t0:.0f} s\n{out[-5000:]}"
    assert "raygrpo: 1 of 1 Ray node(s) up" in out
    steps = read_metrics(run_dir)
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["sync_verified"] for s in steps) and all(s["gen_tokens"] > 0 for s in steps)
