"""Where a TRL-style GRPO step spends its time on a GPU: HF `generate` vs reference forward vs training.

`raygrpo bench --setting long` compares whole steps on the machine at hand; on a CPU generation
cannot dominate (docs/benchmarks.md, "Why the long-completion target is missed"). This probe
measures the premise on a GPU, with torch and transformers alone (no Ray, vLLM or DeepSpeed, so
it runs on a bare GPU image): the long setting's model (31.5M, hidden 512, 8 layers) and batch
(4 prompts x G=8, 128 new tokens, no early stop, micro-batch 16), timing the three parts of the
step TRL's GRPOTrainer takes in one process:

    generate: model.generate, all 32 sequences at once, min_new_tokens = max_new_tokens = 128
    reference: a no-grad forward of the 32 full sequences (the KL term's log-probs)
    train: forward + backward over 2 micro-batches of 16, then one AdamW step

    python -m cluster.bench.gpu_phases [--dtype bfloat16] [--repeats 3] [--static-cache] [--out FILE]

`--static-cache` also times generate with transformers' static KV cache, which compiles the
decode step (CUDA graphs on a GPU): roughly what a graph-capturing engine such as vLLM does
per token, without its batching and paging.

Prints one JSON line per dtype: the median seconds of each part and generation's share.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from cluster.models.tinymodel import TinyModelSpec, build_tiny_model


def _timed(fn, sync) -> float:
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def measure(model_dir: str, dtype_name: str, repeats: int, device: str, static_cache: bool = False) -> dict:
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, dtype_name)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 100, (4, 8), generator=g).repeat_interleave(8, dim=0).to(device)  # 4 prompts x G=8
    new = 128

    def generate(cache: str | None = None):
        with torch.no_grad():
            out = policy.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                                  max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                                  **({"cache_implementation": cache} if cache else {}))
        assert out.shape[1] == prompts.shape[1] + new
        state["seqs"] = out

    def ref_forward():
        with torch.no_grad():
            reference(input_ids=state["seqs"]).logits.float().log_softmax(-1)

    def train():
        for mb in state["seqs"].split(16):
            logp = policy(input_ids=mb).logits.float().log_softmax(-1)
            (-logp[:, :-1].gather(-1, mb[:, 1:, None]).mean()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    state: dict = {}
    times: dict[str, list[float]] = {"generate": [], "reference": [], "train": []}
    for i in range(repeats + 1):  # the first round warms up (kernels, allocator)
        for name, fn in (("generate", generate), ("reference", ref_forward), ("train", train)):
            t = _timed(fn, sync)
            if i:
                times[name].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    total = sum(med.values())
    extra = {}
    if static_cache:
        ts = [_timed(lambda: generate("static"), sync) for _ in range(repeats + 2)]  # two warm-ups: compiling
        extra = {"generate_static_cache_s": round(statistics.median(ts[2:]), 4),
                 "generate_static_cache_first_s": round(ts[0], 2)}
    return {**extra, "dtype": dtype_name, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "torch": torch.__version__, "sequences": int(prompts.shape[0]), "new_tokens": new,
            **{f"{k}_s": round(v, 4) for k, v in med.items()}, "step_s": round(total, 4),
            "generate_share": round(med["generate"] / total, 3), "repeats": repeats}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32,bfloat16", help="comma-separated torch dtypes")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--static-cache", action="store_true")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = TinyModelSpec(hidden_size=512, num_layers=8, num_heads=16, num_kv_heads=8, intermediate_size=2048, seed=0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_model(f"{tmp}/long-model", spec))
        for name in args.dtype.split(","):
            rows.append(measure(model_dir, name.strip(), args.repeats, device, args.static_cache))
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
