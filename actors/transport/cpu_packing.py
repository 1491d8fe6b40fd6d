"""rollout.cpu_pack_above_elements' way into vLLM: the plugin (vllm_plugin.py) runs inside vLLM's model
loading, which takes no raygrpo config, so the RolloutWorker passes it in an environment variable; vLLM used
without a RolloutWorker gets the default. Apart from the plugin because the plugin imports torch (seconds)
and the config (actors/config.py: the field's default) is read by the driver's quick config check.
"""
PACK_ABOVE_ENV = "RAYGRPO_CPU_PACK_ABOVE_ELEMENTS"
DEFAULT_PACK_ABOVE_ELEMENTS = 128 * 1024  # rollout.cpu_pack_above_elements' default (actors/config.py)
