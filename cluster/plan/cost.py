"""Seconds per phase of one step, and what each schedule waits for.

A step trains on B prompts x G completions, each of p prompt tokens and on average m completion tokens,
the longest M (the tail: rollout.max_new_tokens unless told otherwise). Lengths are taken as uniform on
[0, min(2m, M)], so a micro-batch of b right-padded sequences is padded to the expected longest,
U b / (b + 1) (U = min(2m, M)).

    generation   one engine serves n = BG/E sequences, c at a time (its KV cache, vLLM's max_num_seqs):
                 n m / r(c) + a(c) + (M - m) / r(1) + prefill     r(c): decode tokens/s at c sequences
                 (a(c): a call's fixed seconds, measured on `local`; the third term is the tail: the longest
                 completion finishing alone)
    reference    forward of BG (p + m) tokens (algo.beta > 0), on the learner ranks or its own device
    reward       BG completions x the measured (or assumed) cost of one
    training     mu x padded tokens x (6 or 8) P / (R F e), plus ZeRO's traffic per micro-batch:
                 stage 0-1 an all-reduce of the grads per step, 2 a reduce-scatter per micro-batch,
                 3 also the weights gathered 2 (3 with checkpointing) times per micro-batch
    weight sync  w P bytes over the link from learner rank 0 to the engines, plus the update's overhead
                 (colocated: through host memory, gloo: NCCL refuses two ranks on one device); on `local`
                 plus each engine's measured share of the update (its load of the weights), E times
    overhead     the driver's per-step cost outside the phases (Ray calls, batching, logging): measured on
                 `local` by the calibration's run fit, 0 on a spec

    sync      step = generation + reward + reference + training + weight sync + overhead  (every step: + overhead)
    async     step = max(generation + reward [+ reference actor], training [+ reference on learner])
                     + weight sync                  (colocated: nothing overlaps, the sum)
    pipeline  step = max(generation without its tail x the engine loop's factor + the feeder's wait,
                         training) + weight sync
              (the engines refill freed slots at once, so the tail costs nothing; the idle share of an engine
              is 1 - its busy time / step). The engine loop (actors/pipeline.py) steps the engine from a
              thread, each sample its own request, while the feeder polls it: its busy time over a plain
              generate call of the same work is measured on `local` (profile.py pipeline_loop_factor).
              The feeder's wait (feeder_wait_s): with under two steps' groups in flight
              (trainer.pipeline_groups_in_flight, 0: max_staleness x prompts_per_step), an engine that
              finished its share has nothing to do until the learner takes the batch and the feeder's next
              top-up refills it, half a poll period on average (cluster/driver/pipeline_bounds.py POLL_S),
              and its last group waits for the feeder's next poll, half a period again: one POLL_S a step.
              With two steps' groups or more it works on the next batch meanwhile: no wait.
              The update (rollout.kv_after_update=recompute) prefills the running requests again, their
              prompt and half their completion on average: paid when it lands on running requests, every
              step with two steps in flight, else when the engine side is the longer (the learner's update
              comes while it generates; a faster engine sits idle by then). Measured on `local`
              (profile.py recompute_s), a prefill on a spec.
    colocated step = the sum, as sync: learner rank i and engine i time-slice one device (both resident:
              the learner's peak and the engine's gpu_memory_utilization x memory must fit together)
    On `local` the overlapping sides share the cores: cluster/plan/cores.py.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from cluster.driver.pipeline_bounds import POLL_S
from cluster.plan.cores import contention_factor, local_threads, overlapped
from cluster.plan.memory import EngineMemory, LearnerLayout, LearnerMemory, engine_memory, learner_memory
from cluster.plan.shapes import ModelShape

MODES = ("sync", "async", "pipeline")


@dataclass(frozen=True)
class Workload:
    """One step's work, from the run's config."""

    prompts: int
    group: int
    prompt_tokens: int
    mean_new_tokens: float
    max_new_tokens: int
    max_model_len: int
    mu: int
    beta: float
    max_staleness: int
    dtype_bytes: int
    gpu_memory_utilization: float
    eager: bool
    # rollout.threads, learner.threads, reference.threads (> 0 pins a role's threads; 0: the thread budget)
    threads: tuple[int, int, int] = (0, 0, 0)
    # trainer.mode=pipeline: the groups in flight over all engines (cluster/driver/pipeline_bounds.py
    # in_flight_bound; 0: max_staleness x prompts_per_step, as the feeder resolves 0 by default)
    in_flight_groups: int = 0
    # rollout.kv_after_update == "recompute": an update that lands on running requests prefills them again
    kv_recompute: bool = True

    @property
    def sequences(self) -> int:
        return self.prompts * self.group

    def padded_new_tokens(self, micro_batch: int) -> float:
        u = min(2 * self.mean_new_tokens, self.max_new_tokens)
        return max(self.mean_new_tokens, u * micro_batch / (micro_batch + 1))


@dataclass(frozen=True)
class Candidate:
    """A placement and schedule. `colocate`: learner rank i and engine i share one device."""

    engines: int
    tp: int
    ranks: int
    zero_stage: int
    micro_batch: int
    mode: str
    offload: bool = False
    gradient_checkpointing: bool = False
    reference: str = "none"  # none | learner | actor
    colocate: bool = False
    spread: bool = False  # ray.strategy SPREAD: the learner ranks land on every node, their traffic crosses nodes

    def devices(self) -> int:
        ref = 1 if self.reference == "actor" else 0
        return max(self.ranks, self.engines * self.tp) + ref if self.colocate else self.ranks + self.engines * self.tp + ref

    def describe(self) -> str:
        return (f"{self.engines} engine(s) x TP{self.tp}, {self.ranks} learner rank(s) ZeRO-{self.zero_stage}"
                f"{' +offload' if self.offload else ''}, micro-batch {self.micro_batch}"
                f"{' +ckpt' if self.gradient_checkpointing else ''}, {self.mode}, reference {self.reference}"
                f"{', colocated' if self.colocate else ''}{', SPREAD' if self.spread else ''}")


@dataclass
class Prediction:
    candidate: Candidate
    step_s: float
    phases: dict[str, float]
    learner: LearnerMemory
    engine: EngineMemory | None
    engine_idle_fraction: float
    problems: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {"step_s": self.step_s, "phases": self.phases, "learner_peak_bytes": self.learner.peak,
                "learner_memory": self.learner.to_dict(), "engine_memory": self.engine.to_dict() if self.engine else None,
                "engine_idle_fraction": self.engine_idle_fraction, "placement": asdict(self.candidate),
                "fits": self.fits, "problems": self.problems, "sources": self.sources}


def training_s(speeds, shape: ModelShape, wl: Workload, c: Candidate, cross_node: bool) -> float:
    per_rank = math.ceil(wl.sequences / c.ranks)
    micro = math.ceil(per_rank / c.micro_batch) * wl.mu
    micro_tokens = c.micro_batch * (wl.prompt_tokens + wl.padded_new_tokens(c.micro_batch))
    compute = speeds.train_s(micro * micro_tokens, c.micro_batch, c.gradient_checkpointing, micro_tokens)
    nbytes = shape.params() * wl.dtype_bytes
    if c.zero_stage <= 1:
        comm = 2 * speeds.collective_s(nbytes, c.ranks, cross_node) * wl.mu
    else:
        gathers = (3 if c.gradient_checkpointing else 2) if c.zero_stage == 3 else 0
        comm = micro * (1 + gathers) * speeds.collective_s(nbytes, c.ranks, cross_node)
    if c.offload:  # grads down and weights up over PCIe (~25 GB/s), Adam on the host (~1e9 params/s a rank)
        comm += wl.mu * (2 * nbytes / c.ranks / 25e9 + shape.params() / c.ranks / 1e9)
    return compute + comm


def generation_s(speeds, wl: Workload, c: Candidate, concurrent: int) -> tuple[float, float]:
    """(body, tail) seconds of one engine's share of the step."""
    n = math.ceil(wl.sequences / c.engines)
    conc = max(1, min(concurrent, n))
    ctx = int(wl.prompt_tokens + wl.mean_new_tokens / 2)
    body = (n * wl.mean_new_tokens / speeds.decode_tokens_per_s(conc, ctx, c.tp) + speeds.call_s(conc)
            + speeds.prefill_s(n * wl.prompt_tokens) / c.tp)
    tail = max(wl.max_new_tokens - wl.mean_new_tokens, 0) / speeds.decode_tokens_per_s(1, wl.max_model_len, c.tp)
    return body, tail


def feeder_wait_s(wl: Workload) -> float:
    """Seconds a step of trainer.mode=pipeline waits on the feeder (module docstring): one poll period when
    the groups in flight are under two steps' (the engine idles between its last group and the next top-up),
    else 0 (it generates the next batch meanwhile)."""
    in_flight = wl.in_flight_groups or wl.max_staleness * wl.prompts
    return POLL_S if in_flight < 2 * wl.prompts else 0.0


def predict(shape: ModelShape, wl: Workload, c: Candidate, speeds, device_bytes: float, devices_per_node: int,
            total_devices: int, local: bool = False, headroom: float = 1.0) -> Prediction:
    """The prediction for one candidate: phases, step time, memory, and what does not fit."""
    nodes = max(1, total_devices // devices_per_node)
    learner_nodes = min(nodes, c.ranks) if c.spread else math.ceil(c.ranks / devices_per_node)
    lay = LearnerLayout(ranks=c.ranks, zero_stage=c.zero_stage, dtype_bytes=wl.dtype_bytes, micro_batch=c.micro_batch,
                        # the peak is the worst micro-batch's: every completion at max_new_tokens
                        seq_len=wl.prompt_tokens + wl.max_new_tokens, completion_len=wl.max_new_tokens,
                        gradient_checkpointing=c.gradient_checkpointing,
                        offload_optimizer=c.offload, offload_params=c.offload and c.zero_stage == 3,
                        ranks_per_node=min(c.ranks, devices_per_node), reference_copy=c.reference == "learner")
    mem = learner_memory(shape, lay)
    mem = _measured_memory(mem, speeds, c) if local else mem
    seqs = math.ceil(wl.sequences / c.engines)
    problems = []
    eng = None
    if not local:
        eng = engine_memory(shape, device_bytes, wl.gpu_memory_utilization, c.tp, wl.dtype_bytes, wl.max_model_len,
                            seqs, int(wl.prompt_tokens + wl.mean_new_tokens), wl.eager)
        if not eng.starts:
            problems.append(f"engine: {eng.weights / 1e9:.1f} GB of weights + {eng.activation_peak / 1e9:.1f} GB activations "
                            f"leave {eng.kv_cache / 1e9:.1f} GB of KV cache in rollout.gpu_memory_utilization "
                            f"{wl.gpu_memory_utilization} x {device_bytes / 1e9:.0f} GB, under one sequence's "
                            f"{eng.kv_needed_one / 1e9:.2f} GB")
        # colocated: the engine keeps its gpu_memory_utilization share of the device beside the learner
        room = device_bytes * (headroom - (wl.gpu_memory_utilization if c.colocate else 0.0))
        if mem.peak > room:
            problems.append(f"learner: {mem.peak / 1e9:.1f} GB per device (states {mem.states / 1e9:.1f}, activations "
                            f"{(mem.activations + mem.logits) / 1e9:.1f}) > {room / 1e9:.1f} GB")
        if c.devices() > total_devices:
            problems.append(f"needs {c.devices()} devices, the cluster has {total_devices}")
    concurrent = eng.concurrent if eng else seqs
    body, tail = generation_s(speeds, wl, c, concurrent)
    recompute = 0.0
    if c.mode == "pipeline" and not c.colocate:  # the engine loop's own cost over a generate call (module docstring)
        body *= speeds.pipeline_loop_factor(wl.mean_new_tokens)
        if wl.kv_recompute:  # the running requests: the KV cache's concurrent ones, not the engine's whole share
            running = max(1, min(concurrent, seqs))
            recompute = speeds.recompute_s(running * (wl.prompt_tokens + wl.mean_new_tokens / 2)) / c.tp
    ref = speeds.forward_s(wl.sequences * (wl.prompt_tokens + wl.mean_new_tokens)) if c.reference != "none" else 0.0
    if c.reference == "learner":
        ref /= c.ranks
    train = training_s(speeds, shape, wl, c, cross_node=learner_nodes > 1)
    train_all = None
    if local:  # the cores are shared: each phase at the threads the run's budget gives it (cores.py)
        th = local_threads(c.engines, c.ranks, c.reference == "actor", c.mode, total_devices, wl.threads)
        gen_f = speeds.thread_factor("generation", th["rollout"])
        body, tail, recompute = body * gen_f, tail * gen_f, recompute * gen_f
        ref *= speeds.thread_factor("learner", th["reference" if c.reference == "actor" else "learner"])
        if c.mode == "async":
            all_cores = local_threads(c.engines, c.ranks, c.reference == "actor", "sync", total_devices,
                                      wl.threads)["learner"]
            train_all = train * speeds.thread_factor("learner", all_cores)
        train *= speeds.thread_factor("learner", th["learner"])
        if c.mode != "sync" and not c.colocate:  # both sides compute at once on the same cores (cores.py)
            busy = c.engines * th["rollout"] + c.ranks * th["learner"] + (th["reference"] if c.reference == "actor" else 0)
            measured_at = speeds.contention_threads
            train *= contention_factor(speeds.contention("learner"), busy, total_devices, measured_at)
            gen_c = contention_factor(speeds.contention("generation"), busy, total_devices, measured_at)
            body, tail, recompute = body * gen_c, tail * gen_c, recompute * gen_c
    if c.colocate:  # our colocate sends the weights through host memory (gloo): NCCL refuses one device twice
        sync = speeds.host_transfer_s(shape.params() * wl.dtype_bytes)
    else:
        sync = speeds.transfer_s(shape.params() * wl.dtype_bytes, cross_node=not local and c.devices() > devices_per_node,
                                 engines=c.engines)
    reward = speeds.reward_s(wl.sequences)
    phases, step, busy = schedule(c, body, tail, reward, ref, train, sync, speeds.step_overhead_s(), train_all,
                                  feeder_wait_s(wl), recompute)
    return Prediction(c, step, phases, mem, eng, max(0.0, 1 - busy / step) if step > 0 else 0.0, problems, [speeds.source])


def _measured_memory(mem: LearnerMemory, speeds, c: Candidate) -> LearnerMemory:
    """On this machine: the analytic model plus the run fit's measured extra; without a fit, the plain-torch
    calibration's measured peak at this micro-batch."""
    offset = speeds.learner_memory_offset()
    if offset is not None:
        return replace(mem, measured_extra=offset)
    measured_peak = speeds.peak_learner_bytes(c.micro_batch)
    if measured_peak:
        return replace(mem, activations=max(measured_peak - mem.states - mem.logits, 0.0))
    return mem


def schedule(c: Candidate, body: float, tail: float, reward: float, ref: float, train: float, sync: float,
             overhead: float = 0.0, train_all: float | None = None,
             feeder_wait: float = 0.0, recompute: float = 0.0) -> tuple[dict[str, float], float, float]:
    """(phases, step seconds, engine busy seconds) of one step under c.mode (module docstring). `overhead`:
    the driver's measured per-step cost; `train_all`: on `local` in async, training at every core (cores.py);
    `feeder_wait`: in pipeline, the engine side's wait on the feeder each step (feeder_wait_s), 0 with two steps'
    groups in flight; `recompute`: in pipeline, an update's re-prefill of the running requests."""
    ref_actor = ref if c.reference == "actor" else 0.0
    ref_learner = ref if c.reference == "learner" else 0.0
    gen = body + tail
    phases = {"generation": gen, "generation_tail": tail, "reward": reward, "reference": ref, "training": train,
              "weight_sync": sync, "wait_engines": 0.0, "wait_learner": 0.0, "wait_feeder": 0.0, "recompute": 0.0,
              "overhead": overhead}
    if c.mode == "sync" or c.colocate:  # colocated: engine and learner time-slice one device, nothing overlaps
        return phases, gen + reward + ref + train + sync + overhead, gen
    pipeline_wait = feeder_wait if c.mode == "pipeline" else 0.0
    engine_side = (gen if c.mode == "async" else body) + reward + ref_actor + pipeline_wait
    learner_side = train + ref_learner
    # pipeline: the update lands on running requests with two steps in flight, or when the engines are the slower
    recompute = recompute if c.mode == "pipeline" and (feeder_wait == 0 or engine_side > learner_side) else 0.0
    engine_side += recompute
    core = overlapped(c.mode, engine_side, learner_side, learner_side if train_all is None else train_all + ref_learner)
    phases["wait_engines"] = core - engine_side
    phases["wait_learner"] = core - learner_side
    if c.mode == "pipeline":
        phases["generation"], phases["generation_tail"], phases["wait_feeder"] = body, 0.0, pipeline_wait
        phases["recompute"] = recompute
    return phases, core + sync + overhead, (gen if c.mode == "async" else body + recompute)
