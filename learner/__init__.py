"""The training side: GRPO math, DeepSpeed learner ranks, weight broadcast, checkpoints."""
