"""The speeds a prediction uses, and where each comes from.

`MeasuredSpeeds` reads a calibration profile (`raygrpo bench --calibrate` writes it: this machine, the
config's model); `SpecSpeeds` derives speeds from a device's published spec times the cluster's
efficiency. Both answer the same questions; each answer's `source` says which it is, and
`PublishedSpecSpeeds.OVERHEADS` names the terms that are measured software overheads rather than physics.

Derived from a spec, for a model of P parameters, w bytes a weight, on a device of F FLOP/s (dense bf16)
and B bytes/s of HBM, efficiencies e_c (compute), e_m (memory), e_n (network):

    training     t = k P T / (F e_c s(b))      k = 6 (forward + backward), 8 with gradient checkpointing;
                                               s(b) = n / (n + n0): a micro-batch of n tokens fills the device
                                               only partly (n0 = SATURATION_TOKENS, an assumption)
    forward      t = 2 P T / (F e_c)           (reference log-probs, prefill)
    decode step  t = max((w P / tp + c x ctx x kv) / (B e_m), 2 P c / (tp F e_c))   c sequences of ctx tokens
    transfer     t = bytes / (link e_n)
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cluster.plan.hardware import ClusterSpec
from cluster.plan.shapes import ModelShape

PROFILE_VERSION = 1


class ProfileError(ValueError):
    pass


@dataclass
class CalibrationProfile:
    """What `raygrpo bench --calibrate` measured (one machine, one model). Lists are measured points."""

    machine: str
    cores: int
    model: str
    model_params: int
    dtype_bytes: int
    generation: list[dict] = field(default_factory=list)  # {batch, new_tokens, prompt_tokens, tokens_per_s}
    learner: list[dict] = field(default_factory=list)  # {micro_batch, seq_len, tokens_per_s, peak_bytes}
    sync_bytes_per_s: float = 0.0
    sync_overhead_s: float = 0.0  # a zero-byte broadcast's round: the software floor of an update
    reward_s_per_completion: float = 0.0
    seconds: float = 0.0  # how long the calibration took
    version: int = PROFILE_VERSION

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(asdict(self), indent=1) + "\n")
        return p

    @classmethod
    def load(cls, path: str | Path) -> CalibrationProfile:
        p = Path(path)
        if not p.is_file():
            raise ProfileError(f"--profile {p}: no such file; write one with `raygrpo bench --calibrate CONFIG`")
        data = json.loads(p.read_text())
        if data.get("version") != PROFILE_VERSION:
            raise ProfileError(f"--profile {p}: version {data.get('version')!r}, this raygrpo reads {PROFILE_VERSION}: "
                               "calibrate again")
        prof = cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})
        if not prof.generation or not prof.learner or prof.sync_bytes_per_s <= 0:
            raise ProfileError(f"--profile {p}: generation, learner and sync figures are all needed; calibrate again")
        return prof


def _interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise log-log interpolation, flat beyond the measured range."""
    pts = sorted(points)
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            f = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0)) if x1 > x0 else 0.0
            return math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0)))
    return pts[-1][1]


class MeasuredSpeeds:
    """Speeds from a calibration profile, scaled by parameter count when the plan's model is another one
    (on a CPU every term is about proportional to P: a stated assumption, checked in docs/plan.md)."""

    def __init__(self, profile: CalibrationProfile, shape: ModelShape, path: str = ""):
        self.p, self.shape = profile, shape
        self.scale = shape.params() / max(profile.model_params, 1)
        self.source = f"measured: {path or 'calibration profile'} ({profile.machine}, {profile.model})"
        if abs(self.scale - 1) > 0.01:
            self.source += f", scaled x{self.scale:.2f} by parameters"

    def decode_tokens_per_s(self, batch: int, ctx: int, tp: int = 1) -> float:
        pts = [(g["batch"], g["tokens_per_s"]) for g in self.p.generation]
        return _interpolate(pts, batch) / self.scale

    def prefill_s(self, tokens: float) -> float:
        return 0.0  # in the measured generation rate (each measured call prefilled its prompts)

    def train_s(self, tokens: float, micro_batch: int, checkpointing: bool, micro_tokens: float = 0.0) -> float:
        pts = [(x["micro_batch"], x["tokens_per_s"]) for x in self.p.learner]
        return tokens * self.scale / _interpolate(pts, micro_batch) * (4 / 3 if checkpointing else 1)

    def forward_s(self, tokens: float) -> float:
        pts = [(x["micro_batch"], x["tokens_per_s"]) for x in self.p.learner]
        return tokens * self.scale / (3 * _interpolate(pts, max(pts)[0]))  # forward ~ 1/3 of forward + backward

    def transfer_s(self, nbytes: float, cross_node: bool = False) -> float:
        return nbytes / self.p.sync_bytes_per_s + self.p.sync_overhead_s

    def collective_s(self, nbytes: float, ranks: int, cross_node: bool = False) -> float:
        return 0.0 if ranks <= 1 else nbytes * 2 * (ranks - 1) / ranks / self.p.sync_bytes_per_s

    def reward_s(self, completions: int) -> float:
        return completions * self.p.reward_s_per_completion

    def peak_learner_bytes(self, micro_batch: int) -> float | None:
        pts = [(x["micro_batch"], x["peak_bytes"]) for x in self.p.learner if x.get("peak_bytes")]
        return _interpolate(pts, micro_batch) * self.scale if pts else None


class SpecSpeeds:
    """Speeds derived from the cluster's published device spec x its efficiency (module docstring)."""

    # Terms of an update that are software overhead, not bandwidth: a measured figure replaces them.
    # NeMo-RL's DeepSeek-V3 refit took 47 s against a 3.3 s speed of light: such a gap is this term.
    UPDATE_OVERHEAD_S = 0.05  # per update: NCCL launch, bucket packing, the engines' RPC round (measured on CPU ~ms)
    REWARD_S_PER_COMPLETION = 1e-4
    # tokens of one micro-batch at which a GPU's matmuls run at half their sustained rate (an assumption
    # of the order seen in GEMM benchmarks: a few thousand rows fill an H100; not measured here)
    SATURATION_TOKENS = 1024  # a built-in rule reward in Python (measured here: ~20-100 us)

    def __init__(self, cluster: ClusterSpec, shape: ModelShape, dtype_bytes: int = 2):
        d, e = cluster.device, cluster.efficiency
        self.shape, self.w = shape, dtype_bytes
        self.flops = d.bf16_tflops * 1e12 * e.compute
        self.hbm = d.hbm_gbps * 1e9 * e.memory
        self.intra = d.intra_node_gbps * 1e9 * e.network
        self.inter = d.inter_node_gbps * 1e9 * e.network
        self.source = (f"derived from spec: {d.name} ({d.source}), efficiency compute {e.compute}, memory {e.memory}, "
                       f"network {e.network}; update overhead {self.UPDATE_OVERHEAD_S} s and reward "
                       f"{self.REWARD_S_PER_COMPLETION * 1e3:.1f} ms/completion are assumed overheads, not spec")

    def decode_tokens_per_s(self, batch: int, ctx: int, tp: int = 1) -> float:
        p = self.shape.params()
        mem = (self.w * p / tp + batch * ctx * self.shape.kv_bytes_per_token(self.w) / tp) / self.hbm
        comp = 2 * p * batch / (tp * self.flops)
        # TP > 1: two all-reduces of the batch's hidden states per layer, over NVLink
        comm = 0.0 if tp == 1 else 2 * self.shape.layers * (batch * self.shape.hidden * self.w) / self.intra + 2 * self.shape.layers * 10e-6
        return batch / (max(mem, comp) + comm)

    def prefill_s(self, tokens: float) -> float:
        return 2 * self.shape.params() * tokens / self.flops

    def train_s(self, tokens: float, micro_batch: int, checkpointing: bool, micro_tokens: float = 0.0) -> float:
        fill = micro_tokens / (micro_tokens + self.SATURATION_TOKENS) if micro_tokens else 1.0
        return (8 if checkpointing else 6) * self.shape.params() * tokens / (self.flops * fill)

    def forward_s(self, tokens: float) -> float:
        return 2 * self.shape.params() * tokens / self.flops

    def transfer_s(self, nbytes: float, cross_node: bool = False) -> float:
        return nbytes / (self.inter if cross_node else self.intra) + self.UPDATE_OVERHEAD_S

    def collective_s(self, nbytes: float, ranks: int, cross_node: bool = False) -> float:
        """A ring reduce-scatter or all-gather of `nbytes` over `ranks`: (ranks - 1) / ranks of it crosses each link."""
        if ranks <= 1:
            return 0.0
        return nbytes * (ranks - 1) / ranks / (self.inter if cross_node else self.intra)

    def reward_s(self, completions: int) -> float:
        return completions * self.REWARD_S_PER_COMPLETION

    def peak_learner_bytes(self, micro_batch: int) -> float | None:
        return None
