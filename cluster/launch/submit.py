"""`raygrpo submit`: `raygrpo train` as a Ray job, the user's own files travelling with it.

What the job gets (Ray's runtime env), decided by where the config lives:

- a config inside this checkout (e.g. examples/...), no `--working-dir`: the checkout is the
  job's working dir, uploaded (virtual environments, runs and caches excluded);
- `--working-dir DIR` (default: the config's own directory when it is outside the checkout): DIR
  is the job's working dir, uploaded, and raygrpo's packages (actors/, learner/, cluster/) go
  beside it as `py_modules`. The job runs in its copy of DIR, so the config's relative paths
  (`reward.functions: [my_rewards.py:fn]`, `rollout.env: my_env.py:MyEnv`, data files) mean
  what they mean when you run `raygrpo train` from DIR, on nodes that have never seen DIR; the
  actors inherit the job's runtime env, so an environment file loads on the engines' nodes too.

Ray's job agent may not be ready ("No available agent to submit job, please try again later": the
head is still starting, or another Ray on the node holds the agent's port): submit waits for it,
bounded (`--agent-wait`), and names the likely causes if it never comes. Every request to the
cluster is bounded and says what it waits on (cluster/launch/submit_client.py).
"""
from __future__ import annotations

import secrets
import shlex
import sys
import time
from pathlib import Path

from actors.runtime.user_code import is_file_spec
from cluster.launch.auth import dashboard_auth_mode, explain_auth_failure, use_cluster_auth_mode
from cluster.launch.submit_client import CONNECT_TIMEOUT_S, bounded, make_client, request_timeout
from cluster.launch.upload_check import UploadProblem, check_upload
from cluster.paths import PROJECT_ROOT

# The entrypoint of a submitted job (runs the CLI with the cluster's Python; see the script).
JOB_ENTRY = PROJECT_ROOT / "cluster" / "job_entry.sh"
# What `submit` never uploads to the cluster: environments, runs, caches, VCS data.
SUBMIT_EXCLUDES = [".venv*/", "venv/", "runs/", ".cache/", ".git/", "**/__pycache__/", ".pytest_cache/", ".hypothesis/",
                   "*.egg-info/", ".whl/"]
CODE_PACKAGES = ("actors", "learner", "cluster")  # what py_modules carries in working-dir mode
NO_AGENT = "No available agent"  # Ray's job head, when no node's job agent answers
DROPPED = ("Connection aborted", "RemoteDisconnected")  # requests' words for a connection closed before the answer
# In working-dir mode the job's shell finds job_entry.sh in the py_modules copy of cluster/ through
# PYTHONPATH (Ray puts every py_module's directory there; their paths are Ray's own, without spaces).
_ENTRY = JOB_ENTRY.relative_to(PROJECT_ROOT).as_posix()
FIND_ENTRY = (f'for d in $(echo "$PYTHONPATH" | tr ":" " "); do if [ -f "$d/{_ENTRY}" ]; then '
              f'exec sh "$d/{_ENTRY}" "$@"; fi; done; '
              f'echo "raygrpo: error: {_ENTRY} is on none of this job\'s PYTHONPATH entries ($PYTHONPATH)" >&2; '
              'exit 3')


class SubmitError(ValueError):
    """What to submit does not make sense (bad input: the CLI exits 2)."""


class AgentUnavailable(RuntimeError):
    """The cluster's job agent never answered within the wait."""


def plan(config: Path, working_dir: str | None) -> tuple[Path, Path, list[str]]:
    """(working dir to upload, the config relative to it, py_modules) for a submit of `config`."""
    config = config.resolve()
    inside_checkout = config.is_relative_to(PROJECT_ROOT)
    if working_dir is None and inside_checkout:
        return PROJECT_ROOT, config.relative_to(PROJECT_ROOT), []
    wd = Path(working_dir).resolve() if working_dir else config.parent
    if not wd.is_dir():
        raise SubmitError(f"--working-dir {wd} is not a directory")
    if not config.is_relative_to(wd):
        raise SubmitError(f"the config {config} is not inside the working dir {wd}: the job runs in an uploaded copy of "
                          "the working dir, so put the config there (or pass --working-dir a directory that holds it)")
    if PROJECT_ROOT.is_relative_to(wd):  # the checkout itself (or a directory around it): upload it as it is
        return wd, config.relative_to(wd), []
    return wd, config.relative_to(wd), [str(PROJECT_ROOT / p) for p in CODE_PACKAGES]


def file_problems(cfg, wd: Path) -> tuple[list[str], list[str]]:
    """(problems, warnings) about the files the config names, for a job that runs in a copy of `wd`."""
    problems, warnings = [], []
    named = [(f"reward.functions {s!r}", s.rpartition(":")[0]) for s in cfg.reward.functions if is_file_spec(s)]
    if cfg.rollout.env and ":" in cfg.rollout.env:
        named.append((f"rollout.env {cfg.rollout.env!r}", cfg.rollout.env.rpartition(":")[0]))
    named += [(f"data.{k} {v!r}", v) for k in ("train", "eval") for v in getattr(cfg.data, k).split(",")
              if v.strip() and not v.startswith("task:")]
    for what, path in named:
        p = Path(path.strip())
        if not p.is_absolute():
            if not (wd / p).exists():
                problems.append(f"{what}: {wd / p} does not exist; the job runs in a copy of {wd}, so paths in the config "
                                f"are relative to it")
        elif p.is_relative_to(wd):
            problems.append(f"{what} is an absolute path inside the working dir: on the cluster the copy of {wd} lives "
                            f"elsewhere; write it relative to {wd}: {p.relative_to(wd)}")
        else:
            warnings.append(f"{what} is outside the working dir: it must exist at that path on the cluster's nodes")
    if not Path(cfg.trainer.run_dir).is_absolute():
        warnings.append(f"trainer.run_dir {cfg.trainer.run_dir!r} is relative: the job writes it inside its copy of the "
                        "working dir on the head, which Ray removes with the job; use an absolute path on storage every "
                        "node sees")
    return problems, warnings


def entrypoint(config_rel: Path, overrides: list[str], log_level: str, py_modules: list[str]) -> str:
    """The job's shell command: cluster/job_entry.sh train CONFIG overrides --log-level L ray.address=auto."""
    args = ["train", str(config_rel), *overrides, "--log-level", log_level, "ray.address=auto"]
    if not py_modules:
        return " ".join(["sh", str(JOB_ENTRY.relative_to(PROJECT_ROOT)), *map(shlex.quote, args)])
    return " ".join(["sh", "-c", shlex.quote(FIND_ENTRY), "raygrpo", *map(shlex.quote, args)])


def submit_waiting_for_agent(client, address: str, wait_s: float, say=print, sleep=time.sleep, clock=time.monotonic,
                             **job) -> str:
    """client.submit_job(**job), retried while Ray says no job agent is available, or while the head drops the
    connection before it answers (a head still starting under load: its job endpoint answered 500 after Ray's own
    wait for an agent and closed the connection), for at most wait_s from its first such answer (Ray's head itself
    waits a few seconds before giving it). Every try carries the same submission_id: a try whose answer was lost
    but whose job was made is not made twice (Ray then says that id exists: that job is ours)."""
    job.setdefault("submission_id", f"raysubmit_{secrets.token_hex(8)}")
    deadline = None
    while True:
        try:
            return client.submit_job(**job)
        except Exception as e:
            text = str(e)
            if deadline is not None and job["submission_id"] in text and "already exists" in text:
                return job["submission_id"]
            dropped = any(d in text for d in DROPPED)
            if NO_AGENT not in text and not dropped:
                raise
            if deadline is None:
                deadline = clock() + wait_s
                why = ("dropped the connection before answering the submission" if dropped else
                       f"has no job agent ready yet (Ray: '{NO_AGENT} to submit job')")
                say(f"the cluster at {address} {why}; waiting up to {wait_s:.0f} s for it", flush=True)
            if clock() >= deadline:
                raise AgentUnavailable(agent_advice(address, wait_s, text)) from None
            sleep(2.0)


def agent_advice(address: str, wait_s: float, ray_error: str) -> str:
    return (f"the Ray cluster at {address} has no job agent to take the job after {wait_s:.0f} s (Ray: "
            f"{ray_error.strip().splitlines()[-1][:200].rstrip('.')}). Likely causes: (1) another Ray on the head's node holds the "
            "dashboard agent's port (52365 unless set), so this cluster's agent could not start: start the head with "
            "`ray start --head --dashboard-agent-listen-port=<a free port>` (and --dashboard-agent-grpc-port), or stop "
            "the other Ray; the head's <temp dir>/session_latest/logs/dashboard_agent.log says which port failed; "
            "(2) the head is still starting (a busy machine takes a while after `ray start --head` returns): run the "
            "same command again, or raise --agent-wait")


def submit(args, cfg, log_level: str) -> int:
    """`raygrpo submit CONFIG --address URL [--working-dir DIR] [overrides]`: `cfg` is the config loaded
    without its paths checked (they are checked here, as the job will see them), `log_level` the job's."""
    wd, config_rel, py_modules = plan(Path(args.config), args.working_dir)
    if py_modules or args.working_dir:
        problems, warnings = file_problems(cfg, wd)
        if problems:
            raise SubmitError("; ".join(problems))
        for w in warnings:
            print(f"warning: {w}", file=sys.stderr)
    try:  # a symlink loop or an over-size directory: before Ray spends minutes packing it
        check_upload(wd, SUBMIT_EXCLUDES)
    except UploadProblem as e:
        raise SubmitError(str(e)) from None
    wait = args.agent_wait
    print(f"contacting the Ray cluster at {args.address} (each request: at most {request_timeout(wait):.0f}s without an "
          "answer, --agent-wait or Ray's own wait for a job agent)", file=sys.stderr, flush=True)

    def connect():
        probe_s = min(CONNECT_TIMEOUT_S, wait)
        use_cluster_auth_mode(dashboard_auth_mode(args.address, timeout_s=probe_s), args.address)  # before the client
        return make_client(args.address, wait)

    client = bounded(connect, "asking for its authentication mode and Ray version", args.address, wait,
                     extra_s=CONNECT_TIMEOUT_S)
    runtime_env = {"working_dir": str(wd), "excludes": SUBMIT_EXCLUDES} | ({"py_modules": py_modules} if py_modules else {})
    try:
        job_id = bounded(lambda: submit_waiting_for_agent(
            client, args.address, wait, entrypoint=entrypoint(config_rel, args.overrides, log_level, py_modules),
            runtime_env=runtime_env), "uploading the working dir and submitting the job", args.address, wait,
            whole_call_bound=False)
    except (AgentUnavailable, ConnectionError):
        raise
    except Exception as e:  # a token problem gets its own explanation
        raise (explain_auth_failure(e, args.address) or e) from e
    print(f"submitted job {job_id} to {args.address}" + (f" (working dir {wd}, raygrpo's code beside it)" if py_modules else ""))
    print(f"  logs:   ray job logs --address {args.address} -f {job_id}")
    print(f"  status: ray job status --address {args.address} {job_id}")
    if args.no_wait:
        return 0
    from ray.job_submission import JobStatus

    seen = 0
    while True:
        status = bounded(lambda: client.get_job_status(job_id), f"the status of job {job_id}", args.address, wait)
        logs = bounded(lambda: client.get_job_logs(job_id), f"the logs of job {job_id}", args.address, wait)
        sys.stdout.write(logs[seen:])
        sys.stdout.flush()
        seen = len(logs)
        if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
            print(f"job {job_id}: {status.value}")
            return 0 if status == JobStatus.SUCCEEDED else 1
        time.sleep(2)
