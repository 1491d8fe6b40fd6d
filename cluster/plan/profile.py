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

PROFILE_VERSION = 2  # 2: the run fit's per-token generation factor, per-engine update, contention


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
    threads: int = 0  # torch threads of the generation and learner points (0: an old profile, half the cores)
    # {"generation": s, "learner": s, "threads": C}: each side's speed-up from `threads` to C threads (Amdahl)
    thread_speedup: dict = field(default_factory=dict)
    # {"learner": s, "generation": s, "threads": t}: a learner rank's step time while one engine generates
    # beside it (both at t threads, two processes), over its time alone; and the engine's, the same way
    contention: dict = field(default_factory=dict)
    # What a short `raygrpo train` of this model measured and what the points alone predicted for it
    # (cluster/plan/fit.py RunFit): the actor path's factors, the per-step overhead, the learner's memory offset
    run: dict = field(default_factory=dict)
    # {batch, new_tokens, prompt_tokens, plain_s, loop_busy_s, loop_update_busy_s}: a plain generate call's seconds,
    # the pipeline's engine loop's busy seconds for the same work, and the loop's with an update's cache choice
    # halfway (cluster/bench/calibrate_pipeline.py), at two lengths; empty: not measured
    pipeline_loop: list[dict] = field(default_factory=list)
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


def call_and_token_costs(points: list[dict]) -> dict[int, tuple[float, float]]:
    """{batch: (fixed seconds of a generate call, decode tokens/s)} from the generation points: where a batch
    was measured at two lengths or more, the least-squares line of its call's seconds on its length (the
    intercept: prefill, scheduling, the call's own path; the slope: one decode step of the batch); a batch
    measured at one length has no fixed part, its rate is the point's."""
    by_batch: dict[int, list[tuple[float, float]]] = {}
    for g in points:
        if g.get("seconds") and g.get("new_tokens"):
            by_batch.setdefault(g["batch"], []).append((float(g["new_tokens"]), float(g["seconds"])))
    out = {}
    for g in points:
        if g["batch"] in out:  # one line a batch (the first point of a batch measured at one length keeps its rate)
            continue
        pts = by_batch.get(g["batch"], [])
        if len({n for n, _ in pts}) < 2:
            out[g["batch"]] = (0.0, g["tokens_per_s"])
            continue
        mx, my = sum(n for n, _ in pts) / len(pts), sum(t for _, t in pts) / len(pts)
        slope = sum((n - mx) * (t - my) for n, t in pts) / sum((n - mx) ** 2 for n, _ in pts)
        fixed = my - slope * mx
        if fixed < 0 or slope <= 0:  # within the noise of no fixed part: the line through the origin
            fixed, slope = 0.0, sum(n * t for n, t in pts) / sum(n * n for n, _ in pts)
        out[g["batch"]] = (fixed, g["batch"] / slope)
    return out


class MeasuredSpeeds:
    """Speeds from a calibration profile. Its points were measured in one process at `threads` threads; a
    phase at t threads takes A(t) / A(threads) of that time, A(t) = (1 - f) + f / t with f each side's
    parallel share from the measured speed-up (Amdahl). A generate call costs a fixed part plus its decode
    steps (call_and_token_costs). The run fit (profile.run) multiplies the decode steps and training by
    what a real run measured over what the points predicted for it (the Ray actor path, DeepSpeed, the
    driver), adds each engine's share of the update and the run's per-step overhead. A plan for another model scales by
    parameter count (an assumption that overstated a 4x larger model 1.7x: docs/plan.md); its source says
    so and names the calibration to run instead."""

    def __init__(self, profile: CalibrationProfile, shape: ModelShape, path: str = "", use_run: bool = True):
        self.p, self.shape = profile, shape
        self.call_costs = call_and_token_costs(profile.generation)  # {batch: (fixed s, tokens/s)}, fitted once
        self.scale = shape.params() / max(profile.model_params, 1)
        self.run = profile.run if use_run else {}
        self.use_run = use_run  # False: the points alone and the analytic memory (what the run fit compares)
        self.source = f"measured: {path or 'calibration profile'} ({profile.machine}, {profile.model})"
        if self.run:
            self.source += (f", fitted on a run ({self.run.get('overrides_text', '')}): decode x"
                            f"{self.run['generation_factor']:.2f}, training x{self.run['training_factor']:.2f}, "
                            f"{self.run.get('update_s_per_engine', 0.0):.3f} s of update per engine, "
                            f"{self.run['overhead_s']:.2f} s a step of overhead")
        if abs(self.scale - 1) > 0.01:
            self.source += (f", scaled x{self.scale:.2f} by parameters (not measured: calibrate with "
                            f"`raygrpo bench --calibrate model.path={shape.name}`)")

    @property
    def calibrated_threads(self) -> int:
        return self.p.threads or max(1, self.p.cores // 2)

    def thread_factor(self, side: str, threads: int) -> float:
        """Time at `threads` over time at the calibration's threads: A(threads) / A(calibrated), A above."""
        sp = self.p.thread_speedup
        c, s = sp.get("threads", 0), sp.get(side, 0.0)
        if not c or c <= self.calibrated_threads or s <= 0:
            return self.calibrated_threads / max(threads, 1)  # unmeasured: linear in the cores (an assumption)
        t0 = self.calibrated_threads
        if s < 1:  # more threads were slower (OpenMP's threads waiting on each other on busy cores): as measured
            return 1 + (1 / s - 1) * min(max(threads - t0, 0), c - t0) / (c - t0)
        # s = A(t0) / A(c); solve for f, then A(t) / A(t0)
        f = (1 - s) / ((1 - s) - (1 / t0 - s / c)) if (1 - s) - (1 / t0 - s / c) else 1.0
        f = min(max(f, 0.0), 1.0)
        amdahl = lambda t: (1 - f) + f / max(t, 1)  # noqa: E731
        return amdahl(threads) / amdahl(t0)

    def decode_tokens_per_s(self, batch: int, ctx: int, tp: int = 1) -> float:
        """The decode rate at `batch` sequences (call_and_token_costs' slope), over the run fit's per-token
        factor: a real run's decode step beside the points' (the actor path's share that grows with length)."""
        pts = [(b, rate) for b, (_, rate) in self.call_costs.items()]
        return _interpolate(pts, batch) / self.scale / self.run.get("generation_factor", 1.0)

    def call_s(self, batch: int) -> float:
        """The fixed seconds of one generate call at `batch` sequences (call_and_token_costs' intercept):
        paid once a call whatever its length, so it does not grow with the completions as the rate does."""
        pts = [(b, max(fixed, 1e-9)) for b, (fixed, _) in self.call_costs.items()]
        return _interpolate(pts, batch) * self.scale if pts else 0.0

    def prefill_s(self, tokens: float) -> float:
        return 0.0  # in the measured call's fixed part and rate (each measured call prefilled its prompts)

    def train_s(self, tokens: float, micro_batch: int, checkpointing: bool, micro_tokens: float = 0.0) -> float:
        pts = [(x["micro_batch"], x["tokens_per_s"]) for x in self.p.learner]
        return (tokens * self.scale / _interpolate(pts, micro_batch) * (4 / 3 if checkpointing else 1)
                * self.run.get("training_factor", 1.0))

    def forward_s(self, tokens: float) -> float:
        pts = [(x["micro_batch"], x["tokens_per_s"]) for x in self.p.learner]
        # forward ~ 1/3 of forward + backward
        return tokens * self.scale / (3 * _interpolate(pts, max(pts)[0])) * self.run.get("training_factor", 1.0)

    def transfer_s(self, nbytes: float, cross_node: bool = False, engines: int = 1) -> float:
        """The raw broadcast, plus each engine's share of a run's update (its load_weights and re-pack, the
        fingerprint check: the fit's measured update less the broadcast, at one engine): on shared cores
        the engines' loads do not overlap, so an update to E engines pays it E times."""
        raw = nbytes / self.p.sync_bytes_per_s + self.p.sync_overhead_s
        per_engine = self.run.get("update_s_per_engine", 0.0) * self.scale
        # negative: the fit run's update beat the calibration's broadcast (fit.py): that difference, once
        return raw + (engines * per_engine if per_engine > 0 else per_engine)

    def pipeline_loop_factor(self, new_tokens: float) -> float:
        """The pipeline's engine loop's busy time over a plain generate call's for completions of `new_tokens`
        (1 unmeasured). Its extra is a fixed part (each sample its own request, added and read back one by one)
        and a part per decode step (the step's outputs read as deltas, the feeder's polls taking the GIL), so
        the ratio is linear in 1 / length between the two measured lengths, and held at the nearer beyond."""
        pts = sorted((p["new_tokens"], p["loop_busy_s"] / p["plain_s"]) for p in self.p.pipeline_loop
                     if p.get("plain_s", 0) > 0 and p.get("loop_busy_s", 0) > 0)
        if not pts:
            return 1.0
        (m0, r0), (m1, r1) = pts[0], pts[-1]
        m = min(max(new_tokens, m0), m1)
        if m1 == m0:
            return r0
        return r0 + (r1 - r0) * (1 / m - 1 / m0) / (1 / m1 - 1 / m0)

    def recompute_s(self, tokens: float) -> float:
        """Seconds an engine spends prefilling `tokens` of running requests again after an update
        (rollout.kv_after_update=recompute): the calibration's loop with an update's cache choice halfway less
        the loop without, per token of context the running requests held then (0 unmeasured)."""
        per_token = [(p["loop_update_busy_s"] - p["loop_busy_s"]) / (p["batch"] * (p["prompt_tokens"] + p["new_tokens"] / 2))
                     for p in self.p.pipeline_loop if "loop_update_busy_s" in p]
        return tokens * max(0.0, sum(per_token) / len(per_token)) * self.scale if per_token else 0.0

    def contention(self, side: str) -> float:
        """`side`'s ("learner", "generation") time while the other side computes beside it on this machine's
        cores, over its time alone, as measured for one engine and one rank at `contention["threads"]` each;
        1 unmeasured."""
        return self.p.contention.get(side, 0.0) or 1.0

    @property
    def contention_threads(self) -> int:
        return self.p.contention.get("threads", 0) or self.calibrated_threads

    def collective_s(self, nbytes: float, ranks: int, cross_node: bool = False) -> float:
        return 0.0 if ranks <= 1 else nbytes * 2 * (ranks - 1) / ranks / self.p.sync_bytes_per_s

    def host_transfer_s(self, nbytes: float) -> float:
        return self.transfer_s(nbytes)  # what the calibration measured is gloo through host memory already

    def reward_s(self, completions: int) -> float:
        return completions * self.p.reward_s_per_completion * self.run.get("reward_factor", 1.0)

    def step_overhead_s(self) -> float:
        """The driver's per-step cost outside the phases (Ray calls, batching, logging): measured by the fit."""
        return self.run.get("overhead_s", 0.0)

    def learner_memory_offset(self) -> float | None:
        """Measured peak of the fit's run less the analytic model's for it (DeepSpeed's buffers, the
        allocator); None without a run fit."""
        if not self.use_run:
            return 0.0
        return self.run.get("memory_offset_bytes") if self.run else None

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
    # A colocated pair's update goes through host memory (gloo over the loopback: device -> host copy,
    # TCP, host -> device): an assumed 2 GB/s, the order of a gloo broadcast measured on a CPU host here
    # (cluster/bench/calibrate.py measure_sync), not a spec figure.
    HOST_GLOO_BYTES_PER_S = 2e9

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

    def call_s(self, batch: int) -> float:
        return 0.0  # a spec's generation is its decode steps and prefill_s; a call's software floor is unmeasured

    def transfer_s(self, nbytes: float, cross_node: bool = False, engines: int = 1) -> float:
        # one broadcast reaches every engine (NCCL): the engines' count does not add to it on devices of their own
        return nbytes / (self.inter if cross_node else self.intra) + self.UPDATE_OVERHEAD_S

    def pipeline_loop_factor(self, new_tokens: float) -> float:
        return 1.0  # unmeasured on a spec: the loop's host-side cost is in the efficiencies

    def recompute_s(self, tokens: float) -> float:
        return self.prefill_s(tokens)  # the running requests' context prefilled again

    def contention(self, side: str) -> float:
        return 1.0  # each side on devices of its own

    def host_transfer_s(self, nbytes: float) -> float:
        return nbytes / self.HOST_GLOO_BYTES_PER_S + self.UPDATE_OVERHEAD_S

    def collective_s(self, nbytes: float, ranks: int, cross_node: bool = False) -> float:
        """A ring reduce-scatter or all-gather of `nbytes` over `ranks`: (ranks - 1) / ranks of it crosses each link."""
        if ranks <= 1:
            return 0.0
        return nbytes * (ranks - 1) / ranks / (self.inter if cross_node else self.intra)

    def reward_s(self, completions: int) -> float:
        return completions * self.REWARD_S_PER_COMPLETION

    def thread_factor(self, side: str, threads: int) -> float:
        return 1.0  # a GPU phase's speed does not depend on its host threads

    def step_overhead_s(self) -> float:
        return 0.0  # unmeasured on a spec: in UPDATE_OVERHEAD_S and the efficiencies

    def learner_memory_offset(self) -> float | None:
        return None

    def peak_learner_bytes(self, micro_batch: int) -> float | None:
        return None
