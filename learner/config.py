"""Config of the training side. Every default lives here; cluster/config.py composes these."""
from __future__ import annotations

from dataclasses import dataclass

from learner.grpo import ADVANTAGE_ESTIMATORS, AGGREGATIONS, KL_ESTIMATORS, RATIO_LEVELS


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
    tis_cap: float | None = 2.0  # truncated IS cap for the vLLM-vs-trainer mismatch; None: off

    def problems(self) -> list[str]:
        p = []
        for key, value, allowed in (("advantage_estimator", self.advantage_estimator, ADVANTAGE_ESTIMATORS),
                                    ("ratio_level", self.ratio_level, RATIO_LEVELS),
                                    ("aggregation", self.aggregation, AGGREGATIONS),
                                    ("kl_estimator", self.kl_estimator, KL_ESTIMATORS)):
            if value not in allowed:  # the objective's own lists (learner/grpo.py), so they cannot drift
                p.append(f"algo.{key} must be {'|'.join(allowed)}, got {value!r}")
        if self.clip_low < 0 or self.clip_high < 0:
            p.append("algo.clip_low and algo.clip_high must be >= 0")
        if self.beta < 0:
            p.append(f"algo.beta must be >= 0, got {self.beta}")
        if self.tis_cap is not None and self.tis_cap <= 0:
            p.append(f"algo.tis_cap must be > 0 or null, got {self.tis_cap}")
        return p


@dataclass
class LearnerConfig:
    """DeepSpeed ranks (one Ray actor each) and the optimizer."""

    num_ranks: int = 1
    zero_stage: int = 2
    offload_optimizer: bool = False
    offload_params: bool = False
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
    num_cpus: float = 0.5
    num_gpus: float = 0.0

    def problems(self) -> list[str]:
        p = []
        if self.num_ranks < 1:
            p.append(f"learner.num_ranks must be >= 1, got {self.num_ranks}")
        if self.zero_stage not in (0, 1, 2, 3):
            p.append(f"learner.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.offload_params and self.zero_stage != 3:
            p.append("learner.offload_params needs learner.zero_stage=3")
        if self.lr <= 0:
            p.append(f"learner.lr must be > 0, got {self.lr}")
        if self.lr_schedule not in ("constant", "linear", "cosine"):
            p.append(f"learner.lr_schedule must be constant|linear|cosine, got {self.lr_schedule!r}")
        if self.micro_batch_size < 1:
            p.append(f"learner.micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.mu < 1:
            p.append(f"learner.mu must be >= 1, got {self.mu}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            p.append(f"learner.dtype must be auto|float32|bfloat16, got {self.dtype!r}")
        return p


@dataclass
class CheckpointConfig:
    every: int = 0  # steps between checkpoints; 0: only at the end
    keep: int = 2  # the last K complete checkpoints are kept
    resume: str = "auto"  # auto: latest complete checkpoint in the run dir | none | a checkpoint path

    def problems(self) -> list[str]:
        p = []
        if self.every < 0:
            p.append(f"checkpoint.every must be >= 0, got {self.every}")
        if self.keep < 1:
            p.append(f"checkpoint.keep must be >= 1, got {self.keep}")
        return p
