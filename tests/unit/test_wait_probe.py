"""wait_for's probe (actors/runtime/waits.py): a call that takes longer than a waiting line has a cheap call of
its actor sent at each line, so that a call lost on a connection a partition broke fails then instead of at
Ray's gRPC keepalive (300 s). Ray's `get` is faked here: what a real lost call does is test_partition.py's
(tests/e2e), which reproduces it. Here: the probes are sent, one per line, their ends fetched in the background
and never waited on; a call that fails once a probe went out is the actor's failure, named."""
from __future__ import annotations

import threading
import time

import pytest

from actors.runtime import waits
from actors.runtime.waits import ActorFailed, wait_for


class FakeRay:
    """`ray.get` over string refs: "call" times out `lines` times then answers (or raises `then`); a probe
    ("probe-N") answers at once."""

    def __init__(self, lines: int, then: BaseException | None = None):
        self.lines, self.then = lines, then
        self.probes_fetched: list[str] = []
        self.fetched = threading.Event()

    def get(self, ref, timeout=None):
        from ray.exceptions import GetTimeoutError

        if ref.startswith("probe"):
            self.probes_fetched.append(ref)
            self.fetched.set()
            return {"pid": 1}
        if self.lines:
            self.lines -= 1
            raise GetTimeoutError("not yet")
        if self.then is not None:
            raise self.then
        return "answer"


@pytest.fixture
def fake_ray(monkeypatch):
    import ray  # not at module level: the unit tier imports Ray only where a test uses it (ruff TID253)

    def make(lines, then=None):
        fake = FakeRay(lines, then)
        monkeypatch.setattr(ray, "get", fake.get)
        return fake
    monkeypatch.setattr(waits, "WAITING_LINE_EVERY_S", 0.01)
    return make


def probe_counter():
    sent: list[str] = []

    def probe():
        sent.append(f"probe-{len(sent)}")
        return sent[-1]
    return probe, sent


def test_a_probe_goes_at_each_waiting_line_and_its_answer_is_fetched_in_the_background(fake_ray, capsys):
    fake = fake_ray(lines=3)
    probe, sent = probe_counter()
    assert wait_for("call", "rollout worker 1", "generating", timeout_s=60.0, probe=probe) == "answer"
    assert sent == ["probe-0", "probe-1", "probe-2"]
    assert capsys.readouterr().err.count("waiting on rollout worker 1 (generating)") == 3
    deadline = time.monotonic() + 10
    while len(fake.probes_fetched) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fake.probes_fetched == sent  # drained: Ray never frees an unfetched failed probe onto the console


def test_a_call_that_answers_before_a_waiting_line_sends_no_probe(fake_ray):
    fake_ray(lines=0)
    probe, sent = probe_counter()
    assert wait_for("call", "rollout worker 0", "generating", timeout_s=60.0, probe=probe) == "answer"
    assert sent == []


def test_a_call_that_fails_once_a_probe_went_out_is_named_as_its_actors_failure(fake_ray):
    # the broken connection's calls fail when the probe meets it: the caller's recovery (the pool revives the
    # engine and sends its prompts again) starts then
    from ray.exceptions import ActorUnavailableError

    fake_ray(lines=1, then=ActorUnavailableError("Connection reset by peer", None))
    probe, sent = probe_counter()
    with pytest.raises(ActorFailed) as failed:
        wait_for("call", "rollout worker 1", "generating 4 prompts", timeout_s=60.0, probe=probe)
    assert failed.value.died and failed.value.actor == "rollout worker 1" and sent == ["probe-0"]
    assert "Connection reset by peer" in str(failed.value)


class FakeGroupRay:
    """`ray.get`/`ray.wait` over a group of string refs: call i answers after `lines[i]` waiting lines (None: never
    within the test, as a call a healed partition lost) or raises `fails` once a probe of it went out."""

    def __init__(self, lines: list[int | None], fails: BaseException | None = None):
        self.lines, self.fails, self.probed = lines, fails, set()
        self.probes_fetched: list[str] = []

    def wait(self, refs, num_returns, timeout):
        return [r for r in refs if self.lines[int(r[-1])] == 0], []

    def get(self, refs, timeout=None):
        from ray.exceptions import GetTimeoutError

        if isinstance(refs, str):  # a probe's end, fetched by drain
            self.probes_fetched.append(refs)
            return {"pid": 1}
        if self.fails is not None and self.probed:
            raise self.fails
        if all(n == 0 for n in self.lines):
            return [f"answer-{r[-1]}" for r in refs]
        self.lines = [n if n is None else max(0, n - 1) for n in self.lines]
        time.sleep(timeout or 0)  # as Ray's: the wait takes its timeout
        raise GetTimeoutError("not yet")


@pytest.fixture
def group_ray(monkeypatch):
    import ray

    def make(lines, fails=None):
        fake = FakeGroupRay(lines, fails)
        monkeypatch.setattr(ray, "get", fake.get)
        monkeypatch.setattr(ray, "wait", fake.wait)
        return fake
    monkeypatch.setattr(waits, "WAITING_LINE_EVERY_S", 0.01)
    return make


def group_prober(fake):
    sent: list[str] = []

    def probe(unfinished: list[int]) -> list:
        fake.probed.update(unfinished)
        sent.extend(f"probe-of-call-{i}-#{len(sent)}" for i in unfinished)
        return sent[len(sent) - len(unfinished):]
    return probe, sent


def test_get_probing_probes_only_the_calls_not_done_at_each_line_and_drains_them(group_ray):
    """The learner's wait on the engines' update calls (actors/transport/client.py PendingUpdate.join): call 0
    answers by the first line, call 1 at the third; only call 1 is probed, once at each line it is not done."""
    fake = group_ray([1, 3])
    probe, sent = group_prober(fake)
    assert waits.get_probing(["call-0", "call-1"], 60.0, probe, "a probe") == ["answer-0", "answer-1"]
    assert sent == ["probe-of-call-1-#0", "probe-of-call-1-#1"]
    deadline = time.monotonic() + 10
    while len(fake.probes_fetched) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fake.probes_fetched == sent


def test_get_probing_a_lost_call_fails_once_probed_and_a_silent_one_times_out(group_ray):
    from ray.exceptions import ActorUnavailableError, GetTimeoutError

    fake = group_ray([0, None], fails=ActorUnavailableError("Connection reset by peer", None))
    probe, sent = group_prober(fake)
    with pytest.raises(ActorUnavailableError):  # what the learner's sync raises: the driver sends the update again
        waits.get_probing(["call-0", "call-1"], 60.0, probe, "a probe")
    assert sent == ["probe-of-call-1-#0"]

    fake = group_ray([0, None])
    probe, sent = group_prober(fake)
    with pytest.raises(GetTimeoutError):
        waits.get_probing(["call-0", "call-1"], 0.05, probe, "a probe")
    assert sent and set(fake.probed) == {1}
