"""Published GRPO runs set against this model's prediction (docs/plan.md): `python -m cluster.plan.published`.

Each run gives its model, devices and batch; what it does not give (prompt and completion lengths, the
layout of a colocated step) is assumed, and the assumption is written beside it. Nothing here is fitted
to the published figures: the efficiencies are hardware.py's defaults.
"""
from __future__ import annotations

from dataclasses import dataclass

from cluster.plan.cost import Candidate, Workload, predict
from cluster.plan.hardware import parse_cluster
from cluster.plan.profile import SpecSpeeds
from cluster.plan.shapes import PUBLISHED

NEMO_PERF = "NeMo-RL docs/about/performance-summary.md (v0.5/v0.6)"
VERL_ASYNC = "verl docs/advance/fully_async.md"
NEMO_REFIT = "NeMo-RL refit (NCCL reshard, DP8 -> TP8)"


@dataclass(frozen=True)
class PublishedRun:
    name: str
    source: str
    model: str
    cluster: str
    workload: Workload
    candidate: Candidate
    published: str  # the figure as published
    published_s: float
    measure: str  # what is compared: step_s, or a phase
    assumptions: str


def _wl(prompts, group, prompt, mean_new, max_new, beta=0.0) -> Workload:
    return Workload(prompts=prompts, group=group, prompt_tokens=prompt, mean_new_tokens=mean_new, max_new_tokens=max_new,
                    max_model_len=prompt + max_new, mu=1, beta=beta, max_staleness=1, dtype_bytes=2,
                    gpu_memory_utilization=0.6, eager=False)


# NeMo-RL, Llama-3.1-8B: 64 x 32, average sequence 1,019 tokens (prompt + response)
_LLAMA = _wl(64, 32, 200, 819, 3896, beta=0.001)
_VERL = _wl(512, 16, 512, 3000, 8192, beta=0.001)
RUNS = (
    PublishedRun("Llama-3.1-8B GRPO, 16 H100, colocated", NEMO_PERF, "Llama-3.1-8B-Instruct", "2x8xH100", _LLAMA,
                 Candidate(16, 1, 16, 1, 1, "sync", reference="learner", colocate=True), "92.8 s a step", 92.8, "step_s",
                 "prompt 200 + mean completion 819 (the published 1,019 average), longest 3,896; the logprob pass "
                 "modelled as a reference forward on the learners; ZeRO-1 for Megatron's distributed optimizer "
                 "(optimizer states sharded, weights not gathered), micro-batch 1"),
    PublishedRun("Llama-3.1-8B GRPO, 8 generation + 8 training H100, one step off", NEMO_PERF, "Llama-3.1-8B-Instruct",
                 "2x8xH100", _LLAMA, Candidate(8, 1, 8, 1, 1, "async", reference="learner"), "64.8 s a step", 64.8,
                 "step_s", "as above; one-step-off = trainer.mode=async, staleness 1"),
    PublishedRun("Qwen2.5-Math-7B, 32 H20, colocated", VERL_ASYNC, "Qwen2.5-Math-7B", "4x8xH20", _VERL,
                 Candidate(32, 1, 32, 3, 1, "sync", gradient_checkpointing=True, reference="learner", colocate=True),
                 "790 s a step (gen 357, old logprob 108, update 270)", 790.0, "step_s",
                 "lengths not on the page: prompt 512, mean completion 3,000, longest 8,192 (a DAPO-style math recipe); "
                 "ZeRO-3 with checkpointing for verl's FSDP, micro-batch 1"),
    PublishedRun("Qwen2.5-Math-7B, 32 H20, generation phase", VERL_ASYNC, "Qwen2.5-Math-7B", "4x8xH20", _VERL,
                 Candidate(32, 1, 32, 3, 1, "sync", gradient_checkpointing=True, reference="learner", colocate=True),
                 "gen 357 s", 357.0, "generation", "as above"),
    PublishedRun("Qwen3-4B refit, 8 H100", NEMO_REFIT, "Qwen3-4B", "1x8xH100", _wl(1, 1, 1, 1, 1),
                 Candidate(1, 8, 8, 3, 1, "sync", colocate=True), "0.21-0.34 s", 0.275, "weight_sync",
                 "colocated, as the published reshard: one NVLink broadcast of the bf16 weights plus the assumed 0.05 s update overhead"),
)


def predicted(run: PublishedRun) -> float:
    shape, cluster = PUBLISHED[run.model], parse_cluster(run.cluster)
    pr = predict(shape, run.workload, run.candidate, SpecSpeeds(cluster, shape), cluster.device.memory_bytes,
                 cluster.devices_per_node, cluster.total_devices)
    return pr.step_s if run.measure == "step_s" else pr.phases[run.measure]


def table() -> list[str]:
    rows = ["| run | source | published | predicted | ratio | assumptions |", "| --- | --- | --- | --- | --- | --- |"]
    for r in RUNS:
        p = predicted(r)
        rows.append(f"| {r.name} | {r.source} | {r.published} | {p:.2f} s ({r.measure}) | {p / r.published_s:.2f} | "
                    f"{r.assumptions} |")
    return rows


if __name__ == "__main__":
    print("\n".join(table()))
