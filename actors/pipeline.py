"""EngineLoop: one vLLM engine that never stops (trainer.mode=pipeline).

A thread of the rollout actor steps the engine (`LLMEngine.step`, what `LLM.generate` runs in a
loop) for as long as the run lasts: groups are submitted whenever the driver has prompts, a
group is handed back as soon as its G completions are done, and the slots finished requests free
are taken by the next waiting ones (vLLM's own scheduler). Each of a group's G samples is its
own request (n=1), so a finished sample frees its slot at once.

A weight update lands between two engine steps: `pause()` waits for the step under way to end and
keeps the loop from starting another, the update loads, `resume()` lets it go on. No running
request is dropped. With the engine core in its own process (the GPU default) the core steps on its
own, so an update also stops its scheduler: actors/update_hold.py.

Every token carries the weight version of the step that computed it. vLLM's engine core labels each
step's outputs with the version it holds when the step runs (`EngineCoreOutputs.weight_version`, set
by `update_weight_version` while an update holds the engine), and a finished request's output gives
those labels as spans over its tokens (`CompletionOutput.weight_versions`). The version in the actor
when the outputs are read is not it: a core in its own process queues outputs, and those computed
before an update may be read after it. A request that spans an update carries both versions.

What the cache of a running request holds after an update is a choice (`rollout.kv_after_update`):
  recompute  vLLM preempts every running request and resets the prefix cache
             (`reset_prefix_cache(reset_running_requests=True)`): their KV is prefilled again,
             prompt + tokens so far, by the new weights (AReaL's choice). The new tokens' behaviour
             log-probs are then the new policy's exactly (measured: docs/DESIGN.md, issue 40).
  keep       their KV stays (PipelineRL, prime-rl): no re-prefill, but the new tokens are sampled
             from a mix, new weights over old-weight keys and values; only the per-token
             importance weights of the loss see that.
Either way a request submitted after an update never reuses a prefix cached under an older one:
its prompt carries the version as vLLM's `cache_salt`, which enters the hash of its first block.

This module imports no vLLM at its top (the rollout actor does, through `llm`).
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from actors.completions import FINISH_REASONS, Completion, PromptRollout
from actors.runtime.threads import use_threads

KV_CHOICES = ("recompute", "keep")


@dataclass
class _Sample:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class _Group:
    key: int
    prompt_ids: list[int]
    samples: list[_Sample]
    submitted_version: int

    def done(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class EngineLoop:
    """Steps `llm`'s engine in a thread; see the module's docstring."""

    def __init__(self, llm, sampling_params: Callable, decode: Callable, version: Callable[[], int],
                 kv_after_update: str, threads: Callable[[], int], lora_request=None):
        """sampling_params(): one sample's SamplingParams; decode(list of id lists) -> texts;
        version(): the engine's weight version now (a new request's cache salt); threads(): the torch threads
        to compute with."""
        if kv_after_update not in KV_CHOICES:
            raise ValueError(f"kv_after_update must be one of {KV_CHOICES}, got {kv_after_update!r}")
        self.llm, self.engine = llm, llm.llm_engine
        self.sampling_params, self.decode, self.version = sampling_params, decode, version
        self.kv_after_update, self.threads, self.lora_request = kv_after_update, threads, lora_request
        self._cv = threading.Condition()
        self._waiting: list[_Group] = []  # submitted, not yet added to the engine
        self._running: dict[int, _Group] = {}  # key -> group in the engine
        self._done: list[_Group] = []
        self._pause_requests = 0
        self._stepping = False
        self._stop = False
        self._error: BaseException | None = None
        # utilization: seconds stepping with requests, seconds paused for updates, tokens sampled
        self.busy_s = self.pause_s = 0.0
        self.tokens = self.updates = 0
        self._pause_t0: float | None = None
        self.started = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the driver's side
    def submit(self, groups: list[tuple[int, list[int], int]]) -> None:
        """groups: (key, prompt ids, G); the key names the group when it comes back."""
        self._raise_if_failed()
        with self._cv:
            for key, ids, g in groups:
                self._waiting.append(_Group(int(key), [int(t) for t in ids], [_Sample() for _ in range(g)], -1))
            self._cv.notify_all()

    def take(self) -> list[PromptRollout]:
        """Every group finished since the last call (arrival order), with `key` in `prompt`."""
        self._raise_if_failed()
        with self._cv:
            done, self._done = self._done, []
        out = []
        texts = iter(self.decode([s.token_ids for g in done for s in g.samples]))
        for g in done:
            comps = [Completion(s.token_ids, s.logprobs, next(texts), s.finish_reason, versions=s.versions)
                     for s in g.samples]
            oldest = min((v for c in comps for v in c.versions), default=g.submitted_version)
            out.append(PromptRollout(g.key, g.prompt_ids, comps, oldest))
        return out

    def in_flight(self) -> int:
        """Groups submitted and not yet taken back finished (the engine's queue depth)."""
        with self._cv:
            return len(self._waiting) + len(self._running)

    def stats(self) -> dict:
        with self._cv:
            wall = time.perf_counter() - self.started
            return {"busy_s": self.busy_s, "wall_s": wall, "pause_s": self.pause_s, "tokens": self.tokens,
                    "updates": self.updates, "waiting": len(self._waiting), "running": len(self._running),
                    "done": len(self._done)}

    def stop(self) -> list[int]:
        """Abort what runs, end the thread; returns the keys of the groups that did not finish."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=60)
        keys = [g.key for g in self._waiting] + list(self._running)
        ids = [f"{k}-{j}" for k, g in self._running.items() for j in range(len(g.samples))]
        if ids:
            self.engine.abort_request(ids)
        self._waiting, self._running = [], {}
        return keys

    # ------------------------------------------------------------------ updates
    def pause(self) -> None:
        """Return once no engine step runs, and keep the loop from starting another until resume()."""
        with self._cv:
            self._pause_requests += 1
            if self._pause_requests == 1:
                self._pause_t0 = time.perf_counter()
            while self._stepping:
                self._cv.wait()

    def resume(self) -> None:
        with self._cv:
            self._pause_requests = max(0, self._pause_requests - 1)
            if self._pause_requests == 0 and self._pause_t0 is not None:
                self.pause_s += time.perf_counter() - self._pause_t0
                self._pause_t0 = None
            self._cv.notify_all()

    def after_update(self) -> dict:
        """Called paused, once new weights are loaded: the cache choice for running requests, and the
        prefix cache emptied where vLLM can (the salt keeps new requests off old blocks anyway)."""
        self.updates += 1
        with self._cv:
            running = sum(len(g.samples) for g in self._running.values())
        if self.kv_after_update == "recompute":
            ok = self.engine.reset_prefix_cache(reset_running_requests=True)
        else:
            ok = self.engine.reset_prefix_cache() if not running else False
        return {"running_requests": running, "prefix_cache_reset": bool(ok)}

    # ------------------------------------------------------------------ the loop
    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the engine loop failed: {type(self._error).__name__}: {self._error}") from self._error

    def _run(self) -> None:
        try:
            use_threads(self.threads())
            while True:
                with self._cv:
                    while not self._stop and (self._pause_requests or not (self._waiting or self._running)):
                        self._cv.wait(timeout=0.5)
                    if self._stop:
                        return
                    self._add_waiting()
                    self._stepping = True
                t0 = time.perf_counter()
                try:
                    outputs = self.engine.step()
                finally:
                    with self._cv:
                        self._stepping = False
                        self.busy_s += time.perf_counter() - t0
                        self._cv.notify_all()
                self._record(outputs)
        except BaseException as e:  # noqa: BLE001 - said by the next submit/take
            self._error = e
            with self._cv:
                self._stepping = False
                self._cv.notify_all()

    def _add_waiting(self) -> None:
        """Hand the waiting groups to vLLM (its scheduler admits them as slots free up). Called with
        the condition held; the prompt's cache salt is the weight version now."""
        from vllm.inputs import TokensPrompt

        version = self.version()
        for g in self._waiting:
            g.submitted_version = version
            prompt = TokensPrompt(prompt_token_ids=g.prompt_ids, cache_salt=f"raygrpo-v{version}")
            for j in range(len(g.samples)):
                self.engine.add_request(f"{g.key}-{j}", prompt, self.sampling_params(), lora_request=self.lora_request)
            self._running[g.key] = g
        self._waiting = []

    def _record(self, outputs) -> None:
        """Append each request's new tokens; a finished one's versions from vLLM's labels (token_versions)."""
        with self._cv:
            for out in outputs:
                key, j = out.request_id.rsplit("-", 1)
                g = self._running.get(int(key))
                if g is None:
                    continue
                s, c = g.samples[int(j)], out.outputs[0]
                new = list(c.token_ids)
                logprobs = [float(step[tok].logprob) for tok, step in zip(new, c.logprobs or [])]
                if len(logprobs) != len(new):
                    raise RuntimeError(f"vLLM returned {len(logprobs)} log-probs for {len(new)} tokens")
                s.token_ids += new
                s.logprobs += logprobs
                self.tokens += len(new)
                if out.finished:
                    if c.finish_reason not in FINISH_REASONS:
                        raise RuntimeError(f"vLLM ended a request with finish_reason {c.finish_reason!r}")
                    s.versions = token_versions(c.weight_versions, len(s.token_ids), out.request_id)
                    s.finish_reason = c.finish_reason
                    if g.done():
                        self._done.append(self._running.pop(g.key))


def token_versions(spans, n: int, request_id: str) -> list[int]:
    """Each of a request's `n` tokens' weight version, from vLLM's spans (`WeightVersionSpan(version, start,
    end)`: tokens start..end-1 were computed by the weights labelled `version`), which must cover them all."""
    spans = list(spans or ())
    versions = [int(sp.version) for sp in spans for _ in range(sp.start, sp.end)]
    if len(versions) != n or (spans and spans[0].start) or any(a.end != b.start for a, b in zip(spans, spans[1:])):
        raise RuntimeError(f"vLLM labelled {len(versions)} of request {request_id}'s {n} tokens with a weight version "
                           f"({spans!r}); every token must carry the version that computed it")
    return versions


@contextlib.contextmanager
def paused(loop: EngineLoop | None):
    """`with paused(loop):` no engine step runs inside (pipeline mode: the rollout actor's EngineLoop);
    a no-op where there is no loop."""
    if loop is None:
        yield
        return
    loop.pause()
    try:
        yield
    finally:
        loop.resume()
