"""Config of the training side. Every default lives here; cluster/config.py composes these."""
from __future__ import annotations

from dataclasses import dataclass, field

from actors.runtime.checks import at_least
from learner.checkpoint_manifest import verify

# vLLM 0.32 accepts only these max_lora_rank values (vllm/config/lora.py); an engine is started
# with the smallest one >= learner.lora_rank.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Every linear projection of a Llama/Qwen-style decoder layer (attention and MLP).
DEFAULT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# The keys of the objective's tables (learner/grpo.py), in their order: grpo.py imports torch (seconds) and
# the config check must stay quick. tests/unit/test_grpo.py fails if these and grpo.py's tables differ.
ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
RATIO_LEVELS = ("token", "sequence")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
# learner.pack_sequences: the config.json model_type of the models whose decoder builds its attention mask with
# transformers' create_causal_mask from position_ids, so packing is exact (learner/packing.py; tests/unit/
# test_packing.py runs qwen2 and llama). Others are refused at config time, not guessed.
PACKABLE_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
BEHAVIOR_CORRECTIONS = ("tis", "decoupled", "none")


@dataclass
class AlgoConfig:
    """The GRPO objective (learner/grpo.py); each knob named after its paper."""

    advantage_estimator: str = "grpo"  # grpo (DeepSeekMath) | dr_grpo (Dr. GRPO) | rloo
    clip_low: float = 0.2  # PPO clip epsilon below 1
    clip_high: float = 0.2  # DAPO clip-higher: set > clip_low (e.g. 0.28)
    ratio_level: str = "token"  # token | sequence (GSPO)
    aggregation: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum-norm (Dr. GRPO)
    beta: float = 0.0  # KL coefficient; 0 starts no reference actor
    kl_estimator: str = "k3"  # k1 | k2 | k3
    tis_cap: float | None = 2.0  # truncated IS cap for the vLLM-vs-trainer mismatch; None: off (with tis)
    # how each token's loss is reweighted from the sampler's log-probs (learner/grpo.py section 6): tis
    # (truncated at tis_cap) | decoupled (AReaL's decoupled PPO: tokens above tis_cap left out) | none
    # (weight 1: no correction, stale tokens trained as on-policy; for comparison, docs/STATUS.md)
    behavior_correction: str = "tis"

    def problems(self) -> list[str]:
        p = []
        for key, value, allowed in (("advantage_estimator", self.advantage_estimator, ADVANTAGE_ESTIMATORS),
                                    ("ratio_level", self.ratio_level, RATIO_LEVELS),
                                    ("aggregation", self.aggregation, AGGREGATIONS),
                                    ("kl_estimator", self.kl_estimator, KL_ESTIMATORS),
                                    ("behavior_correction", self.behavior_correction, BEHAVIOR_CORRECTIONS)):
            if value not in allowed:  # the keys of the objective's own tables (learner/grpo.py)
                p.append(f"algo.{key} must be {'|'.join(allowed)}, got {value!r}")
        if not (0 <= self.clip_low < 1) or self.clip_high < 0:
            p.append(f"algo.clip_low must be in [0, 1) and algo.clip_high >= 0, got {self.clip_low} and {self.clip_high}")
        at_least(p, "algo.beta", self.beta, 0)
        if self.tis_cap is not None and self.tis_cap <= 0:
            p.append(f"algo.tis_cap must be > 0 or null, got {self.tis_cap}")
        return p


@dataclass
class LearnerConfig:
    """DeepSpeed ranks (one Ray actor each) and the optimizer."""

    num_ranks: int = 1
    # auto: 0 on one rank, 2 with more ranks or with offload_optimizer. ZeRO partitions the optimizer state
    # over the ranks; one rank has nothing to partition, and ZeRO-2 there only adds a flat float32 copy of the
    # weights and the copies in and out of it (SmolLM2-135M in float32 on 2 cores: training 14-23% faster at
    # stage 0, docs/STATUS.md). In bfloat16 (dtype auto on GPU) one rank gets 1: DeepSpeed 0.19.8 accumulates
    # gradients in float32 only from stage 1 (its BF16 optimizer, which keeps the float32 master weights bf16
    # needs anyway); stage 0 accumulates them in bf16 (build_ds_config). Resolved when the config is made:
    # every reader sees 0, 1, 2 or 3.
    zero_stage: int | str = "auto"
    offload_optimizer: bool = False
    offload_params: bool = False
    # ZeRO-3 keeps a parameter whole on every rank, never partitioned, when it has at most this many elements:
    # DeepSpeed's stage3_param_persistence_threshold, at DeepSpeed's default. 0 partitions every parameter (the
    # tests' tiny models, whose largest tensor has 65,536 elements, are partitioned at all only so).
    zero3_param_persistence_threshold: int = 100_000
    # DeepSpeed's stage3_max_reuse_distance: a gathered parameter used again within this many elements of the
    # trace is kept. DeepSpeed's default (1e9) makes every release scan the trace ahead until 1e9 elements, the whole
    # trace of a smaller model: with LoRA's many small modules (SmolLM2-135M, 2 ranks) that scan cost 31 s of Python
    # at the step that first replays the trace (docs/benchmarks.md). 0 releases each parameter after its use, as
    # ZeRO-3 does for a model over 1e9 elements; the backward gathers it again.
    zero3_max_reuse_distance: int = 0
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    lr: float = 1e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    warmup_steps: int = 0
    lr_schedule: str = "constant"  # constant | linear | cosine (decays to 0 at trainer.steps)
    grad_clip: float = 1.0
    micro_batch_size: int = 8  # sequences per forward pass on one rank
    mu: int = 1  # inner optimisation passes over each batch (GRPO's mu)
    max_nonfinite_steps: int = 3  # consecutive NaN/inf losses or grads before the run stops
    gradient_checkpointing: bool = False
    # The G completions of a prompt share one forward pass of it (learner/sequences.py; the same
    # log-probs and gradients to float rounding). Not with gradient checkpointing or ZeRO-3.
    prompt_sharing: bool = True
    # Micro-batches without padding: a micro-batch's sequences in one row, position ids restarting per sequence
    # (learner/packing.py; the same log-probs to 1e-5 in float32). Where prompt sharing does not apply (gradient
    # checkpointing, ZeRO-3, or no work saved). Off by default: with the sdpa attention the learner loads,
    # packed attention is one S x S block-diagonal mask (S: the micro-batch's tokens), which costs more than the
    # little padding left once micro-batches are sorted by length (docs/DESIGN.md, issue 57). Llama, Qwen2/3,
    # Mistral only (model_type; others are refused at config time).
    pack_sequences: bool = False
    # LoRA (peft): 0 = full fine-tuning. With a rank, only the adapters train and travel to the engines.
    lora_rank: int = 0
    lora_alpha: float = 16.0  # the adapter's output is scaled by lora_alpha / lora_rank
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_LORA_TARGETS))
    # adapter: only the adapter travels and vLLM applies it (engines start with enable_lora);
    # merged: base + adapter merged layer group by layer group, sent as plain weights (engines without LoRA)
    lora_sync: str = "adapter"
    # With LoRA, algo.beta > 0 and reference.placement auto the reference is the learner's own model
    # with adapters disabled; true (or reference.placement: actor) starts the separate reference actor anyway.
    lora_reference_actor: bool = False
    num_cpus: float = 0.5
    num_gpus: float = 0.0
    threads: int = 0  # torch threads per rank; 0: the thread budget (cluster/launch/thread_budget.py) decides

    def __post_init__(self):
        if self.zero_stage == "auto":
            self.zero_stage = 2 if self.num_ranks > 1 or self.offload_optimizer else 1 if self.bfloat16 else 0

    @property
    def bfloat16(self) -> bool:
        """Whether the ranks train in bfloat16: learner.dtype, where auto is bfloat16 on GPU (devices.resolve_dtype;
        read from num_gpus here, so the config check imports no torch)."""
        return self.dtype == "bfloat16" or (self.dtype == "auto" and self.num_gpus > 0)

    def problems(self) -> list[str]:
        p = []
        at_least(p, "learner.num_ranks", self.num_ranks, 1)
        if self.zero_stage not in (0, 1, 2, 3):
            p.append(f"learner.zero_stage must be auto, 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.zero_stage == 0 and self.bfloat16:
            p.append(f"learner.zero_stage=0 with bfloat16 (learner.dtype={self.dtype}"
                     f"{', on GPU' if self.dtype == 'auto' else ''}): DeepSpeed accumulates gradients in bf16 at stage 0 "
                     "(float32 accumulation needs stage 1 or above); set learner.zero_stage=1 (auto does) or "
                     "learner.dtype=float32")
        if self.offload_optimizer and self.zero_stage == 0:
            p.append("learner.offload_optimizer needs learner.zero_stage 1, 2 or 3 (auto picks 2 with it)")
        if self.offload_params and self.zero_stage != 3:
            p.append("learner.offload_params needs learner.zero_stage=3")
        if self.lr <= 0:
            p.append(f"learner.lr must be > 0, got {self.lr}")
        if self.lr_schedule not in ("constant", "linear", "cosine"):
            p.append(f"learner.lr_schedule must be constant|linear|cosine, got {self.lr_schedule!r}")
        at_least(p, "learner.micro_batch_size", self.micro_batch_size, 1)
        at_least(p, "learner.zero3_param_persistence_threshold", self.zero3_param_persistence_threshold, 0)
        at_least(p, "learner.zero3_max_reuse_distance", self.zero3_max_reuse_distance, 0)
        at_least(p, "learner.mu", self.mu, 1)
        if self.dtype not in ("auto", "float32", "bfloat16"):
            p.append(f"learner.dtype must be auto|float32|bfloat16, got {self.dtype!r}")
        at_least(p, "learner.grad_clip", self.grad_clip, 0, " (0: no clipping)")
        at_least(p, "learner.weight_decay", self.weight_decay, 0)
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                p.append(f"learner.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.adam_eps <= 0:
            p.append(f"learner.adam_eps must be > 0, got {self.adam_eps}")
        at_least(p, "learner.warmup_steps", self.warmup_steps, 0)
        at_least(p, "learner.max_nonfinite_steps", self.max_nonfinite_steps, 1)
        at_least(p, "learner.threads", self.threads, 0, " (0: the thread budget decides)")
        if self.num_cpus < 0 or self.num_gpus < 0:
            p.append(f"learner.num_cpus and learner.num_gpus must be >= 0, got {self.num_cpus} and {self.num_gpus}")
        p += self._lora_problems()
        return p

    @property
    def lora(self) -> bool:
        return self.lora_rank > 0

    def vllm_max_lora_rank(self) -> int:
        """The max_lora_rank to start the engines with: 0 (no vLLM LoRA) unless adapters travel
        (lora_sync=adapter), else the smallest value vLLM accepts that holds lora_rank."""
        if not self.lora or self.lora_sync != "adapter":
            return 0
        return next(r for r in VLLM_LORA_RANKS if r >= self.lora_rank)

    def _lora_problems(self) -> list[str]:
        p = []
        at_least(p, "learner.lora_rank", self.lora_rank, 0, " (0 = full fine-tuning)")
        if self.lora_sync not in ("adapter", "merged"):
            p.append(f"learner.lora_sync must be adapter|merged, got {self.lora_sync!r}")
        if self.lora_rank > VLLM_LORA_RANKS[-1] and self.lora_sync == "adapter":
            p.append(f"learner.lora_rank {self.lora_rank} is above vLLM's largest max_lora_rank "
                     f"({VLLM_LORA_RANKS[-1]}): lower it or set learner.lora_sync=merged")
        if not self.lora:
            return p
        if self.lora_alpha <= 0:
            p.append(f"learner.lora_alpha must be > 0, got {self.lora_alpha}")
        if not 0 <= self.lora_dropout < 1:
            p.append(f"learner.lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if not self.lora_target_modules or not all(isinstance(m, str) and m for m in self.lora_target_modules):
            p.append("learner.lora_target_modules must be a non-empty list of module names (e.g. q_proj)")
        return p


@dataclass
class ReferenceConfig:
    """The frozen reference model that serves log-probs for the KL term (started only when beta > 0)."""

    micro_batch_size: int = 16
    dtype: str = "auto"
    # Who computes the reference log-probs: "actor" (this separate process, its own device: large
    # models; it scores each batch as it is collected, so in the async schedule it overlaps
    # training), "learner" (a frozen copy on every learner rank, in the rank's training loop: no
    # extra hop; with LoRA the base model, adapters off, no copy), "auto" (learner with LoRA and in
    # the sync schedule on CPU, else actor; measured in docs/benchmarks.md).
    placement: str = "auto"
    num_cpus: float = 0.25
    num_gpus: float = 0.0
    threads: int = 0  # torch threads of the reference actor; 0: the thread budget decides
    max_restarts: int = 3
    prompt_sharing: bool = True  # the completions of a prompt share its forward pass (learner/sequences.py)

    def problems(self) -> list[str]:
        p = []
        if self.placement not in ("auto", "actor", "learner"):
            p.append(f"reference.placement must be auto|actor|learner, got {self.placement!r}")
        at_least(p, "reference.threads", self.threads, 0, " (0: the thread budget decides)")
        at_least(p, "reference.micro_batch_size", self.micro_batch_size, 1)
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            p.append(f"reference.dtype must be auto|float32|bfloat16|float16, got {self.dtype!r}")
        if self.num_cpus < 0 or self.num_gpus < 0:
            p.append(f"reference.num_cpus and reference.num_gpus must be >= 0, got {self.num_cpus} and {self.num_gpus}")
        if self.max_restarts < -1:
            p.append(f"reference.max_restarts must be >= 0 (or -1: unlimited), got {self.max_restarts}")
        return p


@dataclass
class CheckpointConfig:
    every: int = 0  # steps between checkpoints; 0: only at the end
    keep: int = 2  # the last K complete checkpoints are kept
    resume: str = "auto"  # auto: latest complete checkpoint in the run dir | none | a checkpoint path

    def problems(self) -> list[str]:
        p = []
        at_least(p, "checkpoint.every", self.every, 0)
        at_least(p, "checkpoint.keep", self.keep, 1)
        if self.resume not in ("auto", "none"):
            # a path: verified exactly as `auto` verifies what it picks
            if not self.resume:
                p.append("checkpoint.resume is empty: use auto, none or a checkpoint directory")
            else:
                p += [f"checkpoint.resume {self.resume!r}: {q}" for q in verify(self.resume)[:5]]
        return p
