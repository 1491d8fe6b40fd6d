"""EngineWeightUpdates: the engine's end of a weight update (vLLM's RL API), LoRA adapters, the fingerprint.

A part of actors/rollout.py's RolloutWorker, mixed into its class rather than held by it: the
learner's client (actors/transport/client.py) and the driver call these methods on the actor's Ray
handle, and Ray finds an actor's remote methods on its class. It owns the weight version the engine
holds, whether an update is under way, the pipeline-mode hold (actors/update_hold.py) and the LoRA
adapter (actors/transport/lora_adapter.py); it reads the engine (`llm`), the torch thread count
(actors/runtime/actor_base.py) and the pipeline part's loop (`_loop`, engine/pipeline_loop.py).

Between start_weight_update and finish_weight_update the engine holds a mix of old and new weights
(and on CPU the packed copies are still the old ones), so generating there would sample from no
real policy: `_updating` makes that an error instead (`_check_not_updating`, which every
generation call runs first).
"""
from __future__ import annotations

import os
import time
from typing import Any

from actors.pipeline import EngineLoop, paused
from actors.runtime.threads import use_threads
from actors.transport.base import LAST_UPDATE_PARTS
from actors.transport.lora_adapter import EngineAdapter
from actors.update_hold import UpdateHold


class EngineWeightUpdates:
    """init/start/update/finish a weight update (or all of it in `apply_weight_update`), the version, adapters."""

    # Of the actor: the engine and its label; of the other parts: the threads and the pipeline's loop.
    llm: Any
    worker_index: int
    threads: int
    _loop: EngineLoop | None

    def _start_weight_updates(self) -> None:
        """Version 0, no update under way; the adapter slot and the pipeline-mode hold on this engine."""
        self._adapter = EngineAdapter(self.llm)  # LoRA adapters from the learner (adapter-mode sync)
        self._hold = UpdateHold(self.llm)  # pipeline mode: no engine step from start to finish of an update
        self._version = 0
        self._updating = False
        self.llm.update_weight_version("0")  # vLLM's own default is the string "default"

    def _check_not_updating(self) -> None:
        if self._updating:
            raise RuntimeError("a weight update is in progress on this engine (start_weight_update without "
                               "finish_weight_update): generation must wait for finish_weight_update")

    def init_weight_transfer_engine(self, request) -> None:
        if self._updating:
            # A trainer died mid-update; vLLM would refuse the next start_weight_update. Close the
            # stale update (a full sync follows this init) before joining the new group.
            try:
                self.llm.finish_weight_update()
            except Exception:  # noqa: BLE001 - the state is being replaced anyway
                pass
            # The hold stays: the weights are half loaded until the full sync that follows finishes.
            self._updating = False
        with paused(self._loop):
            self.llm.init_weight_transfer_engine(request)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    def start_weight_update(self) -> None:
        """Pipeline mode: the engine held between two steps first (actors/update_hold.py), running requests
        kept; finish_weight_update, or a failed update, lets it go on."""
        if not self._updating:
            self._hold.hold(self._loop)
        try:
            self.llm.start_weight_update()
        except BaseException:
            self._hold.release()
            raise
        self._updating = True

    def update_weights(self, request) -> None:
        use_threads(self.threads)
        try:
            self.llm.update_weights(request)
        except BaseException:
            self._updating = False  # vLLM's worker ends the update on a failed chunk, too
            self._hold.release()
            raise

    def finish_weight_update(self, weight_version: int | str | None = None) -> dict:
        """End an update (the gloo engine re-packs vLLM's CPU layers), drop the cached prefixes and
        stamp `weight_version`; returns the seconds of those parts."""
        t0 = time.perf_counter()
        try:
            self.llm.finish_weight_update()
            self._updating = False
            t1 = time.perf_counter()
            loop = {}
            if self._loop is not None:  # requests are running: the rollout.kv_after_update choice
                loop = self._loop.after_update()
            # Cached prefixes hold K/V computed by the old weights.
            elif not self.llm.reset_prefix_cache():
                raise RuntimeError("vLLM could not reset its prefix cache after a weight update")
            if weight_version is not None:
                self.update_weight_version(weight_version)
        finally:
            self._updating = False
            self._hold.release()
        return {"engine_finish_s": t1 - t0, "prefix_reset_and_version_s": time.perf_counter() - t1, **loop}

    def apply_weight_update(self, request, weight_version: int | str, fingerprint_shapes: dict | None = None) -> dict:
        """A whole weight update in one call (one round trip from the sender instead of four):
        start, receive and load every bucket (the sender broadcasts meanwhile), finish (CPU re-pack,
        prefix-cache reset) and stamp `weight_version`. Returns the seconds of its parts and, given
        `fingerprint_shapes`, under "fingerprint" what `weight_fingerprint` would answer right after
        (the weights as they are now, read the same way), sparing the verified sync a second call."""
        LAST_UPDATE_PARTS.clear()
        t0 = time.perf_counter()
        self.start_weight_update()
        self.update_weights(request)
        t1 = time.perf_counter()
        finish = self.finish_weight_update(weight_version)
        out = {"engine_update_s": t1 - t0, **LAST_UPDATE_PARTS, **finish}
        if fingerprint_shapes is not None:
            t2 = time.perf_counter()
            out["fingerprint"] = self.weight_fingerprint(fingerprint_shapes, int(weight_version))
            out["engine_fingerprint_s"] = time.perf_counter() - t2
        return {**out, "engine_total_s": time.perf_counter() - t0}

    def update_weight_version(self, version: int | str) -> None:
        """The learner's step the weights came from (vLLM keeps it as a string, and labels the outputs of
        every step from now on with it). With the loop paused: a core in its own process is reached through
        one ZMQ socket, which the loop's thread also sends on, and a ZMQ socket is not thread-safe."""
        self._version = int(version)
        with paused(self._loop):
            self.llm.update_weight_version(str(self._version))

    def get_weight_version(self) -> str:
        with paused(self._loop):  # as update_weight_version
            return self.llm.get_weight_version()

    def load_adapter(self, tensors: dict, adapter_config: str, version: int) -> dict:
        """Serve the learner's LoRA adapter from now on: `tensors` are peft-named adapter weights,
        `adapter_config` the text of peft's adapter_config.json. They arrive through Ray (no shared
        filesystem); actors/transport/lora_adapter.py writes them to this engine's own temp dir and
        loads them in place under one adapter id (every later generate uses it)."""
        self._adapter.check_enabled()
        self._check_not_updating()
        use_threads(self.threads)
        t0 = time.perf_counter()
        path = self._adapter.load(tensors, adapter_config, version)
        self.update_weight_version(version)
        self._adapter.drop_previous()
        return {"seconds": time.perf_counter() - t0, "path": path}

    def weight_fingerprint(self, shapes: dict, version: int, adapter: bool = False) -> dict:
        """What this engine holds of the learner's tensors `shapes` (actors/transport/fingerprint.py),
        read inside each vLLM worker; the learner compares it with what it sent."""
        self._check_not_updating()
        with paused(self._loop):
            workers = self.llm.collective_rpc("raygrpo_weight_fingerprint", args=(shapes, int(version), adapter))
        return {"engine": f"rollout worker {self.worker_index} (pid {os.getpid()})", "version": self._version,
                "workers": workers}
