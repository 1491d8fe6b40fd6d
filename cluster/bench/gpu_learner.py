"""Learner throughput on one GPU without Ray: `LearnerWorker.train_step` in this process.

`raygrpo bench --parts learner` measures the same through Ray actors; this runs where Ray and vLLM
are not installed (a bare GPU image with deepspeed carried as a wheel). A random Qwen2 of about
0.36B parameters (hidden 896, 24 layers: Qwen2-0.5B's shape with a character-level vocabulary,
so its FLOPs per token are those of the transformer blocks alone), bf16, ZeRO-2 and ZeRO-3, one
rank, 64 sequences of 64 prompt + 192 completion tokens, micro-batch 16 (`--micro-batch`); 1 warm-up step, then
`--steps` timed ones. GFLOP/s = 6 x parameters x processed tokens / s; MFU against `--peak-tflops`.
`--shape smollm2`: SmolLM2-135M-Instruct's architecture instead (Llama, 30 layers, hidden 576, 9 query and
3 key/value heads, tied embeddings, its 49,152-token vocabulary), random weights, so no model file has to
travel to the GPU box; token ids are drawn from the whole vocabulary.

    python -m cluster.bench.gpu_learner [--shape qwen2-0.36b|smollm2] [--steps 3] [--stages 2] [--micro-batch 16]
                                        [--peak-tflops 989]

One stage per process: DeepSpeed keeps process-wide state between engines.
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

import torch
import torch.distributed as dist

from actors.runtime.sockets import free_port
from cluster.models.tinymodel import TinyModelSpec, build_tiny_model
from learner.batch import TrainBatch
from learner.config import AlgoConfig, LearnerConfig
from learner.worker import LearnerWorker


def _batch(n: int, prompt: int, completion: int, vocab: int):
    g = random.Random(0)
    comps = [[g.randrange(3, vocab) for _ in range(completion)] for _ in range(n)]
    return TrainBatch(prompt_ids=[[g.randrange(3, vocab) for _ in range(prompt)] for _ in range(n)],
                      completion_ids=comps, advantages=[g.gauss(0, 1) for _ in range(n)],
                      behavior_logp=[[-4.0] * completion for _ in range(n)], pad_id=0)


def smollm2_shaped(out: str) -> str:
    """SmolLM2-135M-Instruct's config (as cluster/models/smollm2.py converts it) with random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
                         rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def measure(model_dir: str, stage: int, steps: int, peak_tflops: float, micro_batch: int = 16, vocab: int = 100) -> dict:
    cfg = LearnerConfig(num_gpus=1, zero_stage=stage, micro_batch_size=micro_batch, lr=1e-6)
    rank = LearnerWorker(model_dir, cfg, AlgoConfig(), rank=0, world_size=1, master_addr="127.0.0.1",
                         master_port=free_port(), total_steps=steps + 1, seed=0)
    n_params = rank.param_counts["total_params"]
    batch = _batch(64, 64, 192, vocab)
    processed = sum(len(p) + len(c) for p, c in zip(batch.prompt_ids, batch.completion_ids))
    rank.train_step(batch)  # warm-up
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        m = rank.train_step(batch)
    torch.cuda.synchronize()
    secs = (time.perf_counter() - t) / steps
    gflops = 6 * n_params * processed / secs / 1e9
    out = {"zero_stage": stage, "micro_batch": micro_batch, "device": torch.cuda.get_device_name(), "parameters": n_params,
           "dtype": str(next(rank.engine.module.parameters()).dtype), "sequences": len(batch),
           "tokens_per_step": processed, "seconds_per_step": round(secs, 4),
           "tokens_per_s": round(processed / secs), "gflops": round(gflops), "mfu": round(gflops / (peak_tflops * 1e3), 4),
           "max_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2), "loss": m["loss"]}
    del rank
    if dist.is_initialized():
        dist.destroy_process_group()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=("qwen2-0.36b", "smollm2"), default="qwen2-0.36b")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--stages", default="2")
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100/H200 SXM: 989)")
    args = p.parse_args(argv)
    spec = TinyModelSpec(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864)
    with tempfile.TemporaryDirectory() as tmp:
        if args.shape == "smollm2":
            model_dir, vocab = smollm2_shaped(f"{tmp}/model"), 49152
        else:
            model_dir, vocab = str(build_tiny_model(f"{tmp}/model", spec)), 100
        for stage in args.stages.split(","):
            row = measure(model_dir, int(stage), args.steps, args.peak_tflops, args.micro_batch, vocab)
            print(json.dumps({"shape": args.shape, **row}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
