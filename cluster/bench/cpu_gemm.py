"""vLLM-CPU linear layers: oneDNN-packed copy vs the live weight (`F.linear`), the measurement
behind `rollout.cpu_pack_above_elements` (actors/transport/vllm_plugin.py; docs/benchmarks.md, round 3).

    python -m cluster.bench.cpu_gemm                       # GEMM times for the bench models' shapes
    python -m cluster.bench.cpu_gemm --model DIR           # + whole generate calls, both paths

Part 1 times, per weight shape, building the packed copy (what every weight update pays per
packed layer) and one GEMM at M = 32, 256 and 2560 rows either way. Part 2 loads one
RolloutWorker in this process and alternates generate calls between the two paths on the same
engine (every layer the default policy leaves live is switched to a packed copy and back).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import actors.transport.vllm_plugin as ext
from actors.config import RolloutConfig
from actors.rollout import RolloutWorker

# (N, K) of qkv, o, gate_up, down, LM head for the bench's three model sizes
SHAPES = {
    "1.0M": [(256, 128), (128, 128), (1024, 128), (128, 512), (128, 128)],
    "7.9M": [(512, 256), (256, 256), (2048, 256), (256, 1024), (128, 256)],
    "31.5M": [(1024, 512), (512, 512), (4096, 512), (512, 2048), (128, 512)],
}


def _ms(fn, n: int = 30) -> float:
    for _ in range(3):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e3


def gemm_table(threads: int) -> None:
    from vllm import _custom_ops as ops

    torch.set_num_threads(threads)
    print(f"GEMM, ms, {threads} thread(s): pack = building the oneDNN copy; then packed / live per M")
    for model, shapes in SHAPES.items():
        for n, k in shapes:
            w = torch.randn(n, k)
            pack = _ms(lambda w=w: ops.create_onednn_mm(w.t(), 32), n=10)
            handle = ops.create_onednn_mm(w.t(), 32)
            cells = []
            for m in (32, 256, 2560):
                x = torch.randn(m, k)
                cells.append(f"M={m} {_ms(lambda x=x, h=handle: ops.onednn_mm(h, x, None)):.3f} / "
                             f"{_ms(lambda x=x, w=w: torch.nn.functional.linear(x, w)):.3f}")
            print(f"{model:>6} {n:>5} x {k:<5} pack {pack:.2f}  " + "  ".join(cells))


def generate_ab(model_dir: str, threads: int, tokens: int, rounds: int) -> None:
    import vllm.model_executor.layers.utils as layer_utils

    cfg = RolloutConfig(max_model_len=256, max_new_tokens=tokens, min_new_tokens=tokens, threads=threads)
    worker = RolloutWorker(model_dir, cfg)
    model = worker.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    live = {m: m.cpu_linear for m in model.modules() if getattr(m, ext._LIVE, False)}
    vllm_dispatch = layer_utils.dispatch_cpu_unquantized_gemm.__wrapped__  # vLLM's own, kept by ext
    packed = {}
    for m, fn in live.items():  # the packed path vLLM itself would have built for this layer
        vllm_dispatch(m, remove_weight=False)
        packed[m], m.cpu_linear = m.cpu_linear, fn
    prompts = [f"{i % 10}+{(i * 7) % 10}=" for i in range(32)]
    times = {"packed": [], "live": []}
    for r in range(rounds + 1):
        order = [("packed", packed), ("live", live)]
        for name, table in (order if r % 2 == 0 else order[::-1]):
            for m, fn in table.items():
                m.cpu_linear = fn
            t = time.perf_counter()
            worker.generate(prompts, 8, list(range(32)), False, tokens)
            if r:  # the first round warms both paths up
                times[name].append(time.perf_counter() - t)
    p, q = statistics.median(times["packed"]), statistics.median(times["live"])
    print(f"generate, {model_dir}, {threads} thread(s), 32 prompts x 8 x {tokens} tokens, {len(live)} layers "
          f"switched: packed {p:.4f} s, live {q:.4f} s, live / packed {q / p:.3f} (median of {rounds})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", help="an HF model directory: also time whole generate calls both ways")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per completion (min_tokens too)")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args(argv)
    gemm_table(args.threads)
    if args.model:
        generate_ab(args.model, args.threads, args.tokens, args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
