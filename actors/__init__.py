"""The generation side: vLLM rollout workers, the reference model, rewards (Ray actors)."""
