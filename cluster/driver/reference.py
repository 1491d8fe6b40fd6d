"""The reference model's log-probs of a batch's completions (the KL term's other half), fetched where the
batch is collected: by the collector (sync, async) and by the pipeline's feeder, each arrival's groups.

The frozen reference depends on the tokens alone, so it belongs to collecting: in the async schedule it runs
while the learner trains on the previous batch. Its calls are waited on by the reference actor's
RestartWatch (cluster/driver/actor_restarts.py): a lost host said and waited out, a new process noticed.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from actors.runtime.waits import wait_for

if TYPE_CHECKING:
    from cluster.driver.actor_restarts import RestartWatch


class ReferenceLogprobs:
    """`ref(prompt_ids, completion_ids)`: per completion, per token, the reference model's log-prob."""

    def __init__(self, handle, timeout_s: float, restarts: RestartWatch | None = None):
        """`handle`: the reference actor; `timeout_s`: trainer.actor_timeout_s; `restarts`: its RestartWatch (None:
        a plain bounded wait, as for a collector made on its own in tests)."""
        self.handle, self.timeout_s, self.restarts = handle, timeout_s, restarts

    def __call__(self, prompt_ids: list, completion_ids: list) -> list:
        def call():
            return self.handle.logprobs.remote(prompt_ids, completion_ids)

        what = ("reference actor", "computing reference log-probs", self.timeout_s)
        if self.restarts is None:
            return wait_for(call(), *what)["logprobs"]
        out = self.restarts.wait(call, self.handle, *what)
        self.restarts.answered_by("reference actor", self.handle, out["pid"], self.timeout_s)
        return out["logprobs"]
