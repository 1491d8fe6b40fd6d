"""Engines that really pause in pipeline mode (issue 57, item 4), with vLLM faked: the order of an update's
calls on the engine (actors/update_hold.py through RolloutWorker's update methods), and each token's version
taken from vLLM's label of the step that computed it (actors/pipeline.py). The real engine core in its own
process: tests/e2e/test_pipeline_engine.py."""
from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import pytest

from actors.config import RolloutConfig
from actors.pipeline import EngineLoop
from actors.rollout import RolloutWorker
from actors.update_hold import UpdateHold


class FakeLLM:
    """What RolloutWorker's update path calls on `vllm.LLM`, written down in order; `fail` names a call that raises."""

    def __init__(self, events: list, fail: str = ""):
        self.events, self.fail = events, fail

    def _call(self, name: str, *args):
        self.events.append((name, *args) if args else name)
        if name == self.fail:
            raise RuntimeError(f"{name} failed")

    def sleep(self, level, mode):
        self._call("scheduler paused", level, mode)

    def wake_up(self, tags):
        self._call("scheduler resumed", tuple(tags))

    def start_weight_update(self):
        self._call("start")

    def update_weights(self, request):
        self._call("update")

    def finish_weight_update(self):
        self._call("finish")

    def update_weight_version(self, version):
        self._call("version", version)

    def init_weight_transfer_engine(self, request):
        self._call("init")

    def reset_prefix_cache(self):
        self._call("prefix cache reset")
        return True


class FakeLoop:
    """actors/pipeline.py EngineLoop as the update path uses it; `paused` counts pauses not yet resumed."""

    def __init__(self, events: list):
        self.events, self.paused = events, 0

    def pause(self):
        self.paused += 1
        self.events.append("loop paused")

    def resume(self):
        self.paused -= 1
        self.events.append("loop resumed")

    def after_update(self):
        self.events.append("kv choice")
        return {"running_requests": 2}


def worker(fail: str = "", pipeline: bool = True) -> tuple[RolloutWorker, list, FakeLoop | None]:
    """A RolloutWorker with its engine faked (the attributes its constructor would set for the update path)."""
    events: list = []
    w = object.__new__(RolloutWorker)
    w.llm = FakeLLM(events, fail)
    w._loop = FakeLoop(events) if pipeline else None
    w._hold = UpdateHold(w.llm)
    w._updating, w._version, w.threads = False, 0, 0
    return w, events, w._loop


HELD = ["loop paused", ("scheduler paused", 0, "keep")]
RELEASED = [("scheduler resumed", ("scheduling",)), "loop resumed"]


def test_an_update_stops_the_scheduler_before_start_and_resumes_it_after_finish():
    w, events, loop = worker()
    w.apply_weight_update(request=None, weight_version=3)
    # the version set with the loop paused (once more): the loop's thread shares the core's socket
    assert events == [*HELD, "start", "update", "finish", "kv choice", "loop paused", ("version", "3"), "loop resumed",
                      *RELEASED]
    assert loop.paused == 0


@pytest.mark.parametrize("fail", ["start", "update", "finish"])
def test_a_failed_update_resumes_the_scheduler_and_the_loop(fail):
    w, events, loop = worker(fail)
    with pytest.raises(RuntimeError, match=f"{fail} failed"):
        w.apply_weight_update(request=None, weight_version=3)
    assert events[:2] == HELD and events[-2:] == RELEASED and events.index(fail) < len(events) - 2
    assert loop.paused == 0
    events.clear()  # the next update holds the engine again
    w.llm.fail = ""
    w.apply_weight_update(request=None, weight_version=4)
    assert events[:2] == HELD and events[-2:] == RELEASED and loop.paused == 0


def test_a_failed_scheduler_pause_lets_the_loop_go_on_and_starts_nothing():
    w, events, loop = worker("scheduler paused")
    with pytest.raises(RuntimeError, match="scheduler paused failed"):
        w.start_weight_update()
    assert events == [*HELD, "loop resumed"] and loop.paused == 0


def test_an_update_a_dead_trainer_left_stays_held_until_the_next_full_sync_finishes():
    """start, then the trainer dies: the weights are half loaded (or on `meta`), so the new trainer's init
    must not let the engine step; the full sync that follows ends the hold, once."""
    w, events, loop = worker()
    w.start_weight_update()
    w.init_weight_transfer_engine(request=None)  # closes the stale update
    assert ("scheduler resumed", ("scheduling",)) not in events and loop.paused >= 1
    w.apply_weight_update(request=None, weight_version=2)
    assert events.count(("scheduler paused", 0, "keep")) == 1 and events.count(("scheduler resumed", ("scheduling",))) == 1
    assert loop.paused == 0


def test_outside_pipeline_mode_the_scheduler_is_left_alone():
    w, events, _ = worker(pipeline=False)
    w.apply_weight_update(request=None, weight_version=1)
    assert events == ["start", "update", "finish", "prefix cache reset", ("version", "1")]


def test_rollout_engine_core_auto_is_the_actor_on_cpu_and_its_own_process_on_gpu():
    assert [RolloutConfig().engine_core_in_own_process(gpu) for gpu in (False, True)] == [False, True]
    assert RolloutConfig(engine_core="process").engine_core_in_own_process(False)
    assert not RolloutConfig(engine_core="in_actor").engine_core_in_own_process(True)
    (problem,) = RolloutConfig(engine_core="multiprocess").problems()
    assert problem.startswith("rollout.engine_core must be auto|process|in_actor, got 'multiprocess'")


# ---------------------------------------------------------------------------------------- token versions
def output(key: str, tokens: list[int], spans=None, finished=False):
    """One request's RequestOutput of a step (RequestOutputKind.DELTA: that step's new tokens)."""
    c = SimpleNamespace(token_ids=tokens, logprobs=[{t: SimpleNamespace(logprob=-0.5)} for t in tokens],
                        finish_reason="length" if finished else None, weight_versions=spans)
    return SimpleNamespace(request_id=key, finished=finished, outputs=[c])


def span(version: str, start: int, end: int):
    return SimpleNamespace(version=version, start=start, end=end)


class QueuedEngine:
    """LLMEngine with its core in its own process: step() hands back outputs the core computed earlier, in
    order; the last one of a request carries vLLM's version spans over all its tokens."""

    def __init__(self, outputs: list):
        self.outputs = outputs

    def add_request(self, request_id, prompt, params, lora_request=None):
        pass

    def step(self):
        return [self.outputs.pop(0)] if self.outputs else []

    def abort_request(self, request_ids):
        pass


def run_loop(monkeypatch, outputs: list, actor_version: int):
    """One group of one sample through a real EngineLoop over `outputs`; the actor's version is `actor_version`
    all along (the update finished before the loop read the old outputs). Returns take()'s rollouts."""
    monkeypatch.setitem(sys.modules, "vllm.inputs", SimpleNamespace(TokensPrompt=dict))  # what _add_waiting builds
    llm = SimpleNamespace(llm_engine=QueuedEngine(outputs))
    loop = EngineLoop(llm, lambda: None, lambda ids: ["x"] * len(ids), lambda: actor_version, "recompute", lambda: 0)
    try:
        loop.submit([(7, [1, 2], 1)])
        t0 = time.monotonic()
        while not (got := loop.take()):
            assert time.monotonic() - t0 < 10, "the group never came back"
            time.sleep(0.005)
        return got
    finally:
        loop.stop()


def test_tokens_computed_before_an_update_and_read_after_it_keep_the_old_version(monkeypatch):
    outputs = [output("7-0", [5, 6, 7]), output("7-0", [8, 9], [span("0", 0, 3), span("1", 3, 5)], finished=True)]
    (rollout,) = run_loop(monkeypatch, outputs, actor_version=1)
    (c,) = rollout.completions
    assert c.token_ids == [5, 6, 7, 8, 9] and c.versions == [0, 0, 0, 1, 1]
    assert rollout.weight_version == 0


def test_tokens_vllm_did_not_label_are_an_error_not_a_guess(monkeypatch):
    outputs = [output("7-0", [5, 6, 7]), output("7-0", [8, 9], [span("1", 3, 5)], finished=True)]
    with pytest.raises(RuntimeError, match="every token must carry the version that computed it"):
        run_loop(monkeypatch, outputs, actor_version=1)
