"""The LoRA adapter path (learner.lora_sync=adapter): only the adapter travels, through Ray, with
no transfer group and no shared filesystem, and each engine serves it with vLLM's LoRA support.

  trainer half  AdapterSync: every learner rank takes part in gathering the adapter (ZeRO-3 gathers
                are collective); rank 0 puts the tensors in the object store once and has every
                engine load them (RolloutWorker.load_adapter).
  engine half   EngineAdapter: vLLM 0.32 loads adapters only from a path, so each version is
                written to this engine's own temp dir and loaded in place under one adapter id,
                which every later generate uses.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable

import torch
from safetensors.torch import save_file

from actors.transport.fingerprint import Recorder, verify_engines


class AdapterSync:
    """Trainer side: `gather()` returns the adapter's peft-named tensors on rank 0 ({} elsewhere); every
    rank calls it (learner/weight_sync.py builds it over the DeepSpeed model)."""

    def __init__(self, gather: Callable[[], dict[str, torch.Tensor]], *, rank: int, rollout_handles: list,
                 config_json: str, timeout_s: float):
        self.gather, self.rank, self.handles = gather, rank, list(rollout_handles)
        self.config_json, self.timeout_s = config_json, timeout_s

    def send(self, version: int) -> dict:
        import ray

        t0 = time.perf_counter()
        tensors = self.gather()
        if self.rank != 0:
            return {"bytes": 0, "seconds": time.perf_counter() - t0, "weight_version": version}
        ref = ray.put(tensors)
        ray.get([h.load_adapter.remote(ref, self.config_json, version) for h in self.handles], timeout=self.timeout_s)
        expected = Recorder(version)
        for name, t in tensors.items():
            expected.add(name, t)
        verify_s = verify_engines(self.handles, expected, adapter=True, timeout_s=self.timeout_s,
                                  scale={n: self.scaling() for n in tensors if ".lora_B." in n})
        return {"bytes": sum(t.numel() * t.element_size() for t in tensors.values()), "verified": True,
                "verify_s": verify_s, "seconds": time.perf_counter() - t0, "weight_version": version}

    def scaling(self) -> float:
        """The factor vLLM folds into lora_B when it loads the adapter (peft's lora_alpha / r, or / sqrt(r))."""
        c = json.loads(self.config_json)
        return c["lora_alpha"] / (math.sqrt(c["r"]) if c.get("use_rslora") else c["r"])

    def shutdown(self) -> None:
        pass


def adapter_dir(tmp: str) -> str:
    """This process's adapter dir, `raygrpo-lora-<pid>`; those of dead processes (engines killed
    by Ray, which runs no cleanup) are removed first."""
    for name in os.listdir(tmp):
        if name.startswith("raygrpo-lora-") and name[13:].isdigit():
            try:
                os.kill(int(name[13:]), 0)
            except ProcessLookupError:
                shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
            except PermissionError:  # alive, another user's
                pass
    path = os.path.join(tmp, f"raygrpo-lora-{os.getpid()}")
    os.makedirs(path, exist_ok=True)
    return path


class EngineAdapter:
    """Engine side, one per RolloutWorker: serves the learner's adapter from its own temp dir, one
    sub-directory per version (the previous one is deleted once the new one is loaded)."""

    def __init__(self, llm):
        self.llm = llm
        self.request = None  # the LoRARequest every generate passes, once an adapter arrived
        self._previous = None
        self._root = None  # this engine's own temp dir for adapter files (vLLM loads from disk)

    def check_enabled(self) -> None:
        if self.llm.llm_engine.vllm_config.lora_config is None:
            raise RuntimeError("load_adapter on an engine started without LoRA (max_lora_rank=0); "
                               "start it with learner.lora_rank > 0 and learner.lora_sync=adapter")

    def load(self, tensors: dict, adapter_config: str, version: int) -> str:
        """Write adapter `version` (peft-named tensors, the text of adapter_config.json) and load it in
        place under one adapter id; returns its directory. vLLM loads it now, not at the next
        generate, so a bad adapter fails the sync. The prefix cache is reset (cached blocks hold K/V
        of the previous adapter)."""
        from vllm.lora.request import LoRARequest

        if self._root is None:
            self._root = adapter_dir(tempfile.gettempdir())
        path = os.path.join(self._root, f"v{int(version)}")
        os.makedirs(path, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            f.write(adapter_config)
        request = LoRARequest("policy", 1, path, load_inplace=True)
        self.llm.llm_engine.add_lora(request)  # loads now (not at the next generate), so errors surface here
        self._previous, self.request = self.request, request
        if not self.llm.reset_prefix_cache():  # cached blocks hold K/V of the previous adapter
            raise RuntimeError("vLLM could not reset its prefix cache after loading an adapter")
        return path

    def drop_previous(self) -> None:
        """Delete the directory of the adapter the last load replaced."""
        old = self._previous
        if old is not None and old.lora_path != self.request.lora_path:
            shutil.rmtree(old.lora_path, ignore_errors=True)
