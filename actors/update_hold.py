"""UpdateHold: an engine that really stands still through a weight update (trainer.mode=pipeline).

In pipeline mode requests run while an update lands (actors/pipeline.py). The update's first call,
`start_weight_update`, can leave the model on half-loaded or `meta` weights (vLLM's layer-wise reload
moves layers to `meta` until their new tensors arrive), so no model step may run from there until
`finish_weight_update` has loaded everything. Two things step a vLLM engine:

- the EngineLoop thread of the rollout actor, calling `LLMEngine.step()`; `EngineLoop.pause()` stops it
  between two steps. With the engine core inside the actor (rollout.engine_core=in_actor) that call is
  what runs a model step, so this is the whole pause.
- the engine core's own busy loop, when the core runs in its own process (rollout.engine_core=process,
  the GPU default: vLLM's v1/engine/core.py `run_busy_loop`). It schedules and runs steps for the
  requests in flight whether or not the actor reads their outputs, so pausing the actor's thread
  leaves it stepping. vLLM's own tool stops it: `LLM.sleep(level=0, mode="keep")`, the engine core's
  `pause_scheduler(mode="keep", clear_cache=False)`: the scheduler schedules nothing more, running
  requests keep their state and KV cache, and the call returns once the core is idle (the step under
  way finished and its outputs sent). `LLM.wake_up(tags=["scheduling"])` is `resume_scheduler`.

The same two vLLM calls serve an in-actor core (vLLM's InprocClient runs them in-process), so there is
one path. Order: the actor's thread first (it is the one that adds requests and reads outputs, and it
must not wait on a paused core), then the scheduler; resumed in the reverse order. The weight version
each token carries comes from the core's own label of the step that computed it (actors/pipeline.py),
so outputs read after the update but computed before it keep the old version.
"""
from __future__ import annotations

from typing import Protocol


class Pausable(Protocol):
    """What the hold needs of actors/pipeline.py EngineLoop."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...


class UpdateHold:
    """Holds one engine still from `hold()` to `release()`; both are idempotent, so every path out of an
    update (finished, failed, abandoned by a trainer that died) may release."""

    def __init__(self, llm):
        """llm: the engine's `vllm.LLM` (its `sleep` / `wake_up` reach the engine core wherever it runs)."""
        self.llm = llm
        self._loop: Pausable | None = None
        self._scheduler_paused = False

    @property
    def held(self) -> bool:
        return self._loop is not None

    def hold(self, loop: Pausable | None) -> None:
        """Stop `loop` (the pipeline's EngineLoop; None outside pipeline mode, where nothing runs during an
        update: Ray runs an actor's calls one at a time) and then the engine core's scheduler."""
        if loop is None or self.held:
            return
        loop.pause()
        self._loop = loop
        try:
            self.llm.sleep(level=0, mode="keep")
            self._scheduler_paused = True
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Resume the scheduler, then the loop (the loop's next step then gets outputs again)."""
        loop, self._loop = self._loop, None
        try:
            if self._scheduler_paused:
                self._scheduler_paused = False
                self.llm.wake_up(tags=["scheduling"])
        finally:
            if loop is not None:
                loop.resume()
