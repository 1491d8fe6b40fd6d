"""`raygrpo bench`: what the system costs, measured in one run on one machine.

Six measurements, each against a baseline that does the same work without our machinery:

1. rollout   generated tokens/s through a RolloutWorker Ray actor vs the same vLLM engine
             called directly (a plain subprocess that builds the same RolloutWorker class, so the
             engine settings are identical, and calls `llm.generate` itself). Same model, prompts,
             n=G, max tokens, per-request seeds: the three paths generate the same tokens.
2. sync      seconds and bytes/s of one full weight update (learner rank 0 -> RolloutWorker through
             vLLM's weight-transfer API, our `gloo` backend) vs a raw broadcast of one flat tensor
             of the same size over the same transport (ProcessGroupGloo over a TCPStore, two
             processes); and sync time as a share of a training step.
3. schedule  step time of trainer.mode=sync vs async on the same config (the first step is
             warm-up and left out), and the async step vs max(generation side, learner side).
4. learner   LearnerWorker.train_step tokens/s under ZeRO-2 and ZeRO-3 on one fixed batch.
5. TRL       TRL's GRPOTrainer on the same task, model, batch, group size, steps and lr, in its own
             environment (.venv-bench, created on demand; it reuses this environment's packages
             through a .pth file and adds only what TRL needs): seconds per step, batch reward, and
             held-out greedy accuracy of both trained models, scored by the same code.
6. lora      weight-sync bytes and seconds with LoRA (adapter mode: only the adapter, through Ray;
             merged mode: merged weights through the transfer path) vs full fine-tuning, and the
             learner's optimizer state bytes LoRA vs full (one ZeRO-2 rank each).

`--setting long` (report.py LONG_SETTINGS) is the regime the design is for: a ~31.5M-parameter
random model, every completion 128 tokens (rollout.min_new_tokens; TRL gets min_new_tokens), so
generation dominates a step; it runs parts 3 and 5 unless --parts names others.

The baseline subprocesses (direct vLLM, TRL) run at the niceness Ray gives its workers, so on a
shared machine both sides of a comparison get the same CPU priority.

Pure helpers (tables, ratios, summaries) come first and are unit-tested; the measurements
start actors and subprocesses. `python -m cluster.bench direct-vllm|trl ...` are the
subprocess entry points (`__main__.py`) (the `__main__` guard matters: vLLM starts processes with spawn).
"""
from cluster.bench.command import main, run_bench  # noqa: F401  (the CLI's entry point)
