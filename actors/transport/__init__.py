"""Weight transport, learner -> vLLM engines: both halves of every backend, since they share the
protocol. base.py is the interface and registry.py the one registry of backends (gloo.py,
nccl.py: one module each); the gloo backend's parts are gloo_protocol.py, gloo_trainer.py,
gloo_engine.py, shared_memory.py and direct_load.py. lora_adapter.py is the LoRA adapter path,
client.py the Ray client that drives the engines' side of an update, vllm_plugin.py what every
vLLM process loads. It imports nothing of the generation side, nothing of learner/ but grpo.py,
nothing of cluster/, and runtime/ imports nothing of it."""
