"""`raygrpo bench --parts rewards`: reward-model scoring throughput and a remote verifier's overhead.

- Reward model: a Qwen2ForSequenceClassification of the bench model's size (random weights: the
  throughput does not depend on them) scored on the bench task's prompts + completions, in the
  process (`RewardModelScorer`) and through a Ray `RewardModelActor` (what a run uses): sequences/s.
- HTTP verifier: examples/verifier_server.py started on 127.0.0.1 as a user starts it, and raygrpo's
  client (`HttpVerifier`) posting batches of the bench's batch size: milliseconds per batch, one
  request at a time (the overhead a batch adds to a step: JSON, HTTP, the loopback) and
  `reward.http_concurrency` at once.
- Isolated Python rewards: a per-sample function (one call per completion, each with its own deadline,
  on `reward.num_procs` worker processes: actors/rewards/pool.py) over batches of 256 to 4,096 completions:
  calls/s, and the CPU-seconds the calling process spent on them. Calls/s that fall as the batch grows are
  work that grows faster than the batch.
"""
from __future__ import annotations

import dataclasses
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from actors.config import RewardConfig
from actors.rewards.http import HttpVerifier
from actors.rewards.model_actor import RewardModelActor, RewardModelScorer
from actors.rewards.pool import RewardPool
from actors.runtime.threads import node_cores
from cluster.models.tinymodel import build_tokenizer
from cluster.paths import PROJECT_ROOT

VERIFIER = PROJECT_ROOT / "examples" / "verifier_server.py"


def random_reward_model(out: Path, hidden_size: int, num_layers: int, seed: int = 0) -> Path:
    """A reward model of the bench model's shape with random weights (cached by shape)."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    if (out / "config.json").is_file():
        return out
    tok = build_tokenizer()
    torch.manual_seed(seed)
    heads = max(1, hidden_size // 32)
    config = Qwen2Config(vocab_size=(len(tok) + 63) // 64 * 64, hidden_size=hidden_size, intermediate_size=4 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                         max_position_embeddings=512, num_labels=1, pad_token_id=tok.pad_token_id)
    Qwen2ForSequenceClassification(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def bench_samples(examples, n: int, seed: int = 0) -> tuple[list[str], list[str], list[str]]:
    """n samples of the task: (prompts, completions: the answer or a near miss, answers)."""
    rng = random.Random(seed)
    picked = [rng.choice(examples) for _ in range(n)]
    completions = [e.fields["answer"] if rng.random() < 0.5 else str(int(e.fields["answer"]) + rng.choice([-10, -1, 1, 10]))
                   for e in picked]
    return [e.prompt for e in picked], completions, [e.fields["answer"] for e in picked]


def bench_reward_model(ray, model_dir: Path, cfg: RewardConfig, prompts: list[str], completions: list[str],
                       repeats: int, timeout_s: float) -> dict:
    """Sequences/s of a reward model: in this process and through a Ray actor (medians of `repeats`)."""
    threads = node_cores()
    local = RewardModelScorer(str(model_dir), cfg)
    local.score(prompts, completions)  # warm-up
    in_process = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        local.score(prompts, completions)
        in_process.append(time.perf_counter() - t0)
    actor = ray.remote(RewardModelActor).options(num_cpus=cfg.model_num_cpus).remote(str(model_dir), cfg)
    try:
        ray.get(actor.set_threads.remote(threads), timeout=timeout_s)
        ray.get(actor.score.remote(prompts, completions), timeout=timeout_s)
        via_actor = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            ray.get(actor.score.remote(prompts, completions), timeout=timeout_s)
            via_actor.append(time.perf_counter() - t0)
    finally:
        ray.kill(actor)
    n = len(prompts)
    return {"sequences": n, "batch_size": cfg.model_batch_size, "threads": threads, "repeats": repeats,
            "in_process_seqs_per_s": n / statistics.median(in_process),
            "actor_seqs_per_s": n / statistics.median(via_actor),
            "model": str(model_dir)}


def bench_http_verifier(prompts: list[str], completions: list[str], answers: list[str], batch_size: int,
                        repeats: int, concurrency: int = 4) -> dict:
    """Milliseconds per batch against examples/verifier_server.py on 127.0.0.1."""
    proc = subprocess.Popen([sys.executable, str(VERIFIER), "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().split()[-1]
        payload = {"prompts": prompts[:batch_size], "completions": completions[:batch_size],
                   "answer": answers[:batch_size]}
        cfg = RewardConfig(http_concurrency=concurrency)
        verifier = HttpVerifier(url, cfg, token="")
        verifier.collect(verifier.start([payload]))  # warm-up (connect, the server's first import)
        one = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            [outcome] = verifier.collect(verifier.start([payload]))
            one.append(time.perf_counter() - t0)
            if not all(ok for ok, _ in outcome.results):
                raise RuntimeError(f"the verifier failed during the bench: {outcome.results[:2]}")
        t0 = time.perf_counter()
        verifier.collect(verifier.start([payload] * (concurrency * repeats)))
        parallel = (time.perf_counter() - t0) / (concurrency * repeats)
        verifier.close()
    finally:
        proc.terminate()
        proc.wait(10)
    return {"batch_size": len(payload["prompts"]), "repeats": repeats, "ms_per_batch": 1000 * statistics.median(one),
            "ms_per_batch_min": 1000 * min(one), "concurrency": concurrency, "ms_per_batch_concurrent": 1000 * parallel,
            "server": f"{VERIFIER.name} (standard library http.server)"}


POOL_BATCHES = (256, 1024, 4096)
PER_SAMPLE_REWARD = "def reward(prompt, completion, **kw):\n    return float(len(completion) % 3)\n"


def bench_reward_pool(workdir: Path, num_procs: int, batches=POOL_BATCHES, timeout_s: float = 60.0) -> dict:
    """Calls/s of a per-sample Python reward through the isolated worker pool, per batch size (one batch each,
    after a warm-up batch), and the caller's CPU-seconds for it."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec = f"{workdir / 'per_sample_reward.py'}:reward"
    (workdir / "per_sample_reward.py").write_text(PER_SAMPLE_REWARD)
    pool = RewardPool([spec], num_procs, timeout_s)
    try:
        def run(n: int) -> tuple[float, float]:
            calls = [(spec, ("one", "1+1=", str(i), {})) for i in range(n)]
            t0, c0 = time.perf_counter(), time.process_time()
            results = pool.run(calls)
            if not all(ok for ok, _ in results):
                raise RuntimeError(f"the reward pool failed during the bench: {results[:2]}")
            return time.perf_counter() - t0, time.process_time() - c0
        run(min(batches))  # warm-up
        rows = []
        for n in batches:
            wall, cpu = run(n)
            rows.append({"calls": n, "calls_per_s": n / wall, "caller_cpu_s": cpu})
    finally:
        pool.close()
    return {"num_procs": num_procs, "batches": rows}


def table_rows(res: dict) -> list[tuple]:
    """The bench table's rows for this part."""
    rows = []
    rm = res.get("reward_model")
    if rm:
        note = f"{rm['sequences']} sequences, batches of {rm['batch_size']}, {rm['threads']} thread(s)"
        rows += [("7 rewards", "reward model, in process", rm["in_process_seqs_per_s"], "sequences/s; " + note),
                 ("7 rewards", "reward model via Ray actor", rm["actor_seqs_per_s"], "sequences/s (RewardModelActor)")]
    hv = res.get("http_verifier")
    if hv:
        rows += [("7 rewards", "HTTP verifier, ms per batch", hv["ms_per_batch"],
                  f"{hv['batch_size']} samples, one request at a time, localhost ({hv['server']})"),
                 ("7 rewards", f"HTTP verifier, {hv['concurrency']} in flight", hv["ms_per_batch_concurrent"],
                  "ms per batch (reward.http_concurrency)")]
    rp = res.get("reward_pool")
    for b in rp["batches"] if rp else ():
        rows.append(("7 rewards", f"Python reward, batch of {b['calls']}", b["calls_per_s"],
                     f"calls/s, per-sample function on {rp['num_procs']} worker process(es); the caller spent "
                     f"{b['caller_cpu_s']:.2f} CPU-s"))
    return rows


def run_part(ray, res: dict, spec, cfg, examples, repeats: int, workdir: Path, timeout_s: float, progress) -> None:
    """Part 7: fills res["reward_model"], res["http_verifier"] and res["reward_pool"]; `spec` gives the reward model's shape
    (hidden_size, num_layers: the bench model's)."""
    rm_cfg = dataclasses.replace(cfg.reward, model_batch_size=max(cfg.reward.model_batch_size, 64))
    n = cfg.trainer.prompts_per_step * cfg.trainer.group_size
    prompts, completions, answers = bench_samples(examples, n)
    model = random_reward_model(workdir / f"reward-model-h{spec.hidden_size}-l{spec.num_layers}", spec.hidden_size,
                                spec.num_layers)
    res["reward_model"] = bench_reward_model(ray, model, rm_cfg, prompts, completions, repeats, timeout_s)
    progress(f"reward model: {res['reward_model']['actor_seqs_per_s']:.0f} sequences/s via its actor")
    res["http_verifier"] = bench_http_verifier(prompts, completions, answers, min(n, cfg.reward.http_max_batch),
                                               max(repeats, 10), cfg.reward.http_concurrency)
    progress(f"HTTP verifier: {res['http_verifier']['ms_per_batch']:.2f} ms per batch of "
             f"{res['http_verifier']['batch_size']} on localhost")
    res["reward_pool"] = bench_reward_pool(workdir / "reward-pool", cfg.reward.num_procs)
    largest = res["reward_pool"]["batches"][-1]
    progress(f"Python reward: {largest['calls_per_s']:.0f} calls/s in a batch of {largest['calls']}")
