"""Weight transport, learner -> vLLM engines: both halves of every backend, since they share the
protocol. The CPU gloo backend's parts are gloo_protocol.py, gloo_trainer.py, gloo_engine.py,
shared_memory.py and direct_load.py; vllm_plugin.py is what every vLLM process loads. It imports
nothing of the generation side, nothing of learner/ but grpo.py, nothing of cluster/."""
