"""The generation side: vLLM rollout workers, the reference model, rewards, multi-turn environments
(Ray actors), on the shared base of runtime/ (what every process shares) and transport/ (weight
transport, both halves)."""
