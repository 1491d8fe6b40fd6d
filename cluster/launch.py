"""Ray resources: start or join a cluster, place and create the actors."""
from __future__ import annotations

import os

# Set in every Ray worker process. No hub access anywhere; one OpenMP thread per actor
# unless told otherwise, so several engines and ranks share a small machine without
# oversubscribing its cores.
WORKER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_DEDUP_LOGS": "0",
}


def worker_runtime_env(extra_env: dict[str, str] | None = None) -> dict:
    env = {k: os.environ.get(k, v) for k, v in WORKER_ENV.items()}
    env.update(extra_env or {})
    return {"env_vars": env}
