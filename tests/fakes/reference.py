"""FakeReference: the reference actor as the driver sees it (learner/reference.py ReferenceActor.logprobs): one
log-prob per completion token, and the pid of the process that answered (how the driver sees a restart)."""
from __future__ import annotations

from tests.fakes.ray_like import FakeActor


class FakeReference(FakeActor):
    def __init__(self, pid: int = 300, logprob: float = -0.25):
        super().__init__(pid)
        self.logprob = logprob
        self.asked: list[int] = []  # how many sequences each call had

    def logprobs(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> dict:
        self.asked.append(len(completion_ids))
        return {"logprobs": [[self.logprob] * len(c) for c in completion_ids], "pid": self.pid}
