"""Bytes per device: a learner rank's model states and activations, an engine's weights and KV cache.

**Learner states** (mixed precision, Adam), in bytes per parameter P, over N data-parallel ranks, with w
the training dtype's size (2 for bf16, 4 for float32). ZeRO partitions more of them the higher its stage:

    term               stage 0   stage 1   stage 2   stage 3      offload_optimizer
    working params     w         w         w         w / N        (offload_params: host)
    working grads      w         w         w / N     -            none (grads go to host buckets)
    fp32 grads         4*        4 / N     4 / N     4 / N        host
    fp32 master        4*        4 / N     4 / N     4 / N        host
    Adam m and v       8         8 / N     8 / N     8 / N        host
    gathered (ZeRO-3)  -         -         -         2 w x Lmax   stays

(*) only when w < 4: a float32 run trains its own weights and grads. Lmax is the largest single module's
parameters, gathered with its gradient at once. This is DeepSpeed's own accounting: for bf16 it gives
`2P + 18P/N` (ZeRO-2) and `4 Lmax + 18P/N` (ZeRO-3), what `estimate_zero2/3_model_states_mem_needs`
return (tests/unit/test_plan_memory.py holds the two to each other).

**Learner activations** for a micro-batch of b sequences of s tokens (c of them completion), per layer per
token, in elements (q, k: query and key/value widths, I: MLP width), after Korthikanti et al. 2022 with
flash attention (no s x s scores kept):

    a = 4h + 2q + 2k + 4I             (norm in/out twice, q/k/v, attention out, gate, up, act, act*up)
    no checkpointing:  w b s L a
    checkpointing:     w b s L h + w b s a  (each layer's input, and one layer recomputed at a time)
    logits:            2 w b c V           (the completion positions' logits and their gradient)

**An engine** (tensor-parallel size t) holds per GPU `w P / t` of weights and a KV cache of
`2 L k w / t` bytes per token; vLLM gives the cache what is left of `gpu_memory_utilization x HBM` after the
weights, its profile run's activation peak and the CUDA context and graphs.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from cluster.plan.shapes import ModelShape

GIB = 2**30
# vLLM's non-torch memory (CUDA context, NCCL, allocator slack) and CUDA graphs: what its memory profile
# reports on an H100 for a 7B model with graphs on (about 1-2 GiB); a measured overhead, not a spec.
ENGINE_OVERHEAD_BYTES = 1.5 * GIB
ENGINE_EAGER_OVERHEAD_BYTES = 0.75 * GIB
# vLLM 0.32's defaults for the LLM class on a GPU with >= 70 GiB (engine/arg_utils.py).
VLLM_MAX_NUM_BATCHED_TOKENS = 16384
VLLM_MAX_NUM_SEQS = 1024


@dataclass(frozen=True)
class LearnerLayout:
    """What decides a learner rank's memory."""

    ranks: int
    zero_stage: int
    dtype_bytes: int  # 2: bf16, 4: float32
    micro_batch: int
    seq_len: int  # prompt + completion tokens of the longest sequence in a micro-batch (right-padded)
    completion_len: int
    gradient_checkpointing: bool = False
    offload_optimizer: bool = False
    offload_params: bool = False
    ranks_per_node: int = 0  # 0: all on one node
    reference_copy: bool = False  # a frozen reference model on every rank (reference.placement=learner)


@dataclass(frozen=True)
class LearnerMemory:
    """Bytes on one rank's device by term, and on its node's host (states offloaded there by every rank of it)."""

    params: float
    grads: float
    optimizer: float  # fp32 grads + master + Adam
    gathered: float
    activations: float
    logits: float
    reference: float
    host: float
    # on `local`: what a run of this model measured beyond this model (DeepSpeed's flat buffers, the
    # allocator's and oneDNN's working memory), the calibration's run fit (profile.py); 0 elsewhere
    measured_extra: float = 0.0

    @property
    def states(self) -> float:
        return self.params + self.grads + self.optimizer + self.gathered

    @property
    def peak(self) -> float:
        return self.states + self.activations + self.logits + self.reference + self.measured_extra

    def to_dict(self) -> dict:
        return {**asdict(self), "states": self.states, "peak": self.peak}


def learner_states(p: int, largest: int, lay: LearnerLayout) -> tuple[dict[str, float], dict[str, float]]:
    """Per-rank (device, host) bytes by term: the table in the module docstring."""
    n, w, s = lay.ranks, lay.dtype_bytes, lay.zero_stage
    part = (lambda x: x / n) if s >= 1 else (lambda x: x)
    fp32_own = 4 if w < 4 else 0  # a float32 run's working copies are its fp32 copies
    params = p * w / (n if s == 3 else 1)
    grads = 0.0 if (s == 3 or lay.offload_optimizer) else p * w / (n if s == 2 else 1)
    master = p * (4 if (w < 4 or s >= 1) else 0)
    fp32_grads = p * (4 if s == 3 else fp32_own)
    optimizer = part(master) + (fp32_grads / n if s >= 1 else fp32_grads) + part(8 * p)
    gathered = 2 * w * largest if s == 3 else 0.0
    device = {"params": params, "grads": grads, "optimizer": optimizer, "gathered": gathered}
    host = {"params": 0.0, "optimizer": 0.0}
    if lay.offload_optimizer:
        host["optimizer"], device["optimizer"] = optimizer, 0.0
    if lay.offload_params and s == 3:
        host["params"], device["params"] = params, 0.0
    return device, host


def activation_bytes(shape: ModelShape, lay: LearnerLayout) -> tuple[float, float]:
    """(activations, logits) of one micro-batch's forward and backward: the module docstring's formulas."""
    h, w, b, s = shape.hidden, lay.dtype_bytes, lay.micro_batch, lay.seq_len
    per_token_layer = shape.activation_elems_per_token()
    if lay.gradient_checkpointing:
        acts = w * b * s * (shape.layers * h + per_token_layer)
    else:
        acts = w * b * s * shape.layers * per_token_layer
    logits = 2 * w * b * lay.completion_len * shape.vocab
    return float(acts), float(logits)


def learner_memory(shape: ModelShape, lay: LearnerLayout) -> LearnerMemory:
    p = shape.params()
    device, host = learner_states(p, shape.largest_leaf_params(), lay)
    acts, logits = activation_bytes(shape, lay)
    per_node = lay.ranks_per_node or lay.ranks
    return LearnerMemory(params=device["params"], grads=device["grads"], optimizer=device["optimizer"],
                         gathered=device["gathered"], activations=acts, logits=logits,
                         reference=float(p * lay.dtype_bytes) if lay.reference_copy else 0.0,
                         host=(host["params"] + host["optimizer"]) * per_node)


@dataclass(frozen=True)
class EngineMemory:
    """One GPU of an engine: what vLLM takes and what its KV cache then holds."""

    budget: float  # gpu_memory_utilization x device memory
    weights: float
    activation_peak: float
    overhead: float
    kv_cache: float  # what is left for it (may be negative: the engine does not start)
    kv_needed_one: float  # one sequence of max_model_len: vLLM refuses to start below this
    kv_needed_step: float  # every sequence of the step this engine serves at once
    concurrent: int  # sequences of the step that fit in the cache at once

    @property
    def starts(self) -> bool:
        return self.kv_cache >= self.kv_needed_one

    def to_dict(self) -> dict:
        return {**asdict(self), "starts": self.starts}


def engine_memory(shape: ModelShape, device_bytes: float, utilization: float, tp: int, dtype_bytes: int,
                  max_model_len: int, seqs_per_engine: int, seq_tokens: int, eager: bool = False) -> EngineMemory:
    """vLLM's split of `utilization x device_bytes` for one GPU of a TP-`tp` engine. vLLM's profile run
    forwards VLLM_MAX_NUM_BATCHED_TOKENS tokens: its peak is about the hidden states of those tokens through
    one layer (4h + 2q + 2k + 4I elements each, as the learner's) plus float32 logits of the sampled rows."""
    budget = utilization * device_bytes
    weights = shape.params() * dtype_bytes / tp
    per_tok = shape.activation_elems_per_token()
    act = (VLLM_MAX_NUM_BATCHED_TOKENS * per_tok * dtype_bytes / tp
           + min(VLLM_MAX_NUM_SEQS, VLLM_MAX_NUM_BATCHED_TOKENS) * shape.vocab * 4 / tp)
    overhead = ENGINE_EAGER_OVERHEAD_BYTES if eager else ENGINE_OVERHEAD_BYTES
    kv = budget - weights - act - overhead
    per_token = shape.kv_bytes_per_token(dtype_bytes) / tp
    concurrent = int(max(kv, 0) // (per_token * max(seq_tokens, 1)))
    return EngineMemory(budget=budget, weights=weights, activation_peak=act, overhead=overhead, kv_cache=kv,
                        kv_needed_one=per_token * max_model_len, kv_needed_step=per_token * seq_tokens * seqs_per_engine,
                        concurrent=min(concurrent, seqs_per_engine, VLLM_MAX_NUM_SEQS))
