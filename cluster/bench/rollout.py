"""1. Rollout throughput: RolloutWorker (Ray actor) vs the same engine called directly."""
from __future__ import annotations

import dataclasses
import json
import os
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from actors.config import RolloutConfig
from actors.rollout import RolloutWorker
from cluster.bench.report import PROTO, SUBPROCESS_MODULE, per_second, progress, ratio
from cluster.launch.ray_cluster import WORKER_ENV
from cluster.paths import PROJECT_ROOT


def direct_vllm_main(spec_path: str) -> int:
    """Subprocess: one vLLM engine built by the RolloutWorker class (same settings as the actor),
    answering commands on stdin: `direct` (llm.generate on the same requests), `wrapper`
    (RolloutWorker.generate in-process, no Ray), `quit`. Protocol lines go to the original stdout,
    everything else (vLLM's logs) to the log file."""
    spec = json.loads(Path(spec_path).read_text())
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    log = open(spec["log"], "a")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log

    cfg = RolloutConfig(**spec["rollout"])
    t0 = time.perf_counter()
    worker = RolloutWorker(spec["model"], cfg)

    proto.write(PROTO + json.dumps({"ready": True, "start_s": time.perf_counter() - t0,
                                    "torch_threads": torch.get_num_threads()}) + "\n")
    prompts, G, seeds, max_new = spec["prompts"], spec["group_size"], spec["seeds"], spec["max_new_tokens"]
    from vllm.inputs import TokensPrompt

    # exactly the requests RolloutWorker.generate builds (one per prompt, n=G, behaviour log-probs)
    reqs = [TokensPrompt(prompt_token_ids=list(worker.tokenizer.encode(p))) for p in prompts]
    params = [worker.sampling_params(G, max_new, s) for s in seeds]
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "quit":
            break
        t = time.perf_counter()
        if cmd == "direct":
            outs = worker.llm.generate(reqs, params, use_tqdm=False)
            tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        elif cmd == "wrapper":
            ro = worker.generate(prompts, G, seeds, False, max_new)
            tokens = sum(len(c.token_ids) for r in ro for c in r.completions)
        else:
            proto.write(PROTO + json.dumps({"error": f"unknown command {cmd!r}"}) + "\n")
            continue
        proto.write(PROTO + json.dumps({"seconds": time.perf_counter() - t, "tokens": tokens}) + "\n")
    return 0


class _DirectEngine:
    """Parent side of the direct-vLLM subprocess."""

    def __init__(self, spec: dict, workdir: Path, timeout_s: float):
        self.timeout_s = timeout_s
        spec_path = workdir / "direct_vllm_spec.json"
        spec_path.write_text(json.dumps(spec))
        env = {**os.environ, **{k: os.environ.get(k, v) for k, v in WORKER_ENV.items()},
               "OMP_NUM_THREADS": str(spec["threads"])}
        self.proc = subprocess.Popen([sys.executable, "-m", SUBPROCESS_MODULE, "direct-vllm", str(spec_path)],
                                     cwd=PROJECT_ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1, preexec_fn=renice_to(spec.get("niceness")))
        self.log = spec["log"]
        self.ready = self._read()

    def _read(self) -> dict:
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"direct vLLM subprocess did not answer in {self.timeout_s:.0f}s (log: {self.log})")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 5.0))
            if not ready:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"direct vLLM subprocess exited with {self.proc.returncode} (log: {self.log})")
                continue
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait(10)
                raise RuntimeError(f"direct vLLM subprocess exited with {self.proc.returncode} (log: {self.log})")
            if line.startswith(PROTO):
                msg = json.loads(line[len(PROTO):])
                if "error" in msg:
                    raise RuntimeError(msg["error"])
                return msg

    def call(self, cmd: str) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(30)
        except Exception:  # noqa: BLE001
            self.proc.kill()
            self.proc.wait(10)


def current_niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, 0)


def renice_to(niceness: int | None):
    """A preexec_fn that runs a baseline subprocess at the niceness Ray gives its workers (15 by
    default), so on a shared machine both sides of a comparison get the same CPU priority."""
    if niceness is None:
        return None

    def fn():
        delta = niceness - current_niceness()
        if delta > 0:
            os.nice(delta)
    return fn


def _timing(calls: list[dict]) -> dict:
    secs, toks = sum(c["seconds"] for c in calls), sum(c["tokens"] for c in calls)
    return {"calls": len(calls), "seconds": secs, "tokens": toks, "tokens_per_call": calls[0]["tokens"] if calls else 0,
            "tokens_per_s": per_second(toks, secs), "seconds_per_call": [round(c["seconds"], 4) for c in calls],
            "median_tokens_per_s": statistics.median(c["tokens"] / c["seconds"] for c in calls) if calls else None}


def bench_rollout(ray, model: str, rcfg, prompts: list[str], group_size: int, max_new: int, repeats: int,
                  workdir: Path, timeout_s: float, niceness: int | None = None):
    """Part 1. Returns (results, the actor handle (kept for part 2), the actor's last rollouts)."""
    seeds = [1000 + i for i in range(len(prompts))]
    threads = max(1, int(rcfg.num_cpus))
    spec = {"model": model, "rollout": dataclasses.asdict(rcfg), "prompts": prompts, "group_size": group_size,
            "niceness": niceness,
            "seeds": seeds, "max_new_tokens": max_new, "threads": threads, "log": str(workdir / "direct_vllm.log")}
    progress(f"rollout: starting the direct vLLM engine (subprocess) and a RolloutWorker actor ({threads} thread(s) each)")
    direct = _DirectEngine(spec, workdir, timeout_s)
    actor = ray.remote(RolloutWorker).options(num_cpus=rcfg.num_cpus, num_gpus=rcfg.num_gpus).remote(model, rcfg)
    try:
        info = ray.get(actor.info.remote(), timeout=timeout_s)

        def via_ray():
            t = time.perf_counter()
            ro = ray.get(actor.generate.remote(prompts, group_size, seeds, False, max_new), timeout=timeout_s)
            return {"seconds": time.perf_counter() - t, "tokens": sum(len(c.token_ids) for r in ro for c in r.completions)}, ro

        direct.call("direct"), direct.call("wrapper"), via_ray()  # warm-up (first full-size batch)
        calls = {"direct": [], "wrapper": [], "actor": []}
        rollouts = None
        for _ in range(repeats):  # interleaved, so a change in machine load hits all three alike
            calls["direct"].append(direct.call("direct"))
            calls["wrapper"].append(direct.call("wrapper"))
            c, rollouts = via_ray()
            calls["actor"].append(c)
    except BaseException:
        ray.kill(actor)
        raise
    finally:
        direct.close()
    res = {k: _timing(v) for k, v in calls.items()}
    res |= {"prompts": len(prompts), "group_size": group_size, "max_new_tokens": max_new, "threads": threads,
            "repeats": repeats, "direct_start_s": direct.ready.get("start_s"), "actor_start_s": info.get("start_seconds"),
            "actor_torch_threads": info.get("torch_threads"), "direct_torch_threads": direct.ready.get("torch_threads")}
    res["actor_vs_direct"] = ratio(res["actor"]["tokens_per_s"], res["direct"]["tokens_per_s"])
    res["wrapper_vs_direct"] = ratio(res["wrapper"]["tokens_per_s"], res["direct"]["tokens_per_s"])
    toks = {c["tokens"] for v in calls.values() for c in v}
    res["same_tokens"] = len(toks) == 1
    return res, actor, rollouts
