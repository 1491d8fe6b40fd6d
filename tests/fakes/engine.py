"""FakeEngine: a rollout engine as the driver sees it (actors/rollout.py RolloutWorker's remote methods: generate,
generate_multiturn, info, set_threads, the pipeline loop's calls), with the weight version it holds. A new process
holds the base weights (version 0), so its answers are stale until the driver re-syncs it
(FakeLearnerRank.sync_weights sets `weight_version`)."""
from __future__ import annotations

from actors.completions import Completion, PromptRollout
from actors.multiturn.trajectories import MultiTurnRollout, Trajectory
from tests.fakes.ray_like import FakeActor


class FakeEngine(FakeActor):
    def __init__(self, index: int, pid: int, completion_len: int = 2):
        super().__init__(pid)
        self.index, self.completion_len = index, completion_len
        self.weight_version = 0  # what it holds: the base weights until an update lands
        self.wrong_weights = False  # its fingerprint will not match what the learner sent (SyncMismatch)
        self.env_reset_error: str | None = None  # rollout.env's reset() raises this on every trajectory
        self.served: list[list[int]] = []  # the seeds of each generate call it answered
        # a driver that asks one engine more often than this loops (e.g. reviving for ever an engine it never
        # re-synced): the test fails at once with this, not at its timeout
        self.max_calls = 50
        self.loop_running, self.in_flight = False, []  # trainer.mode=pipeline's engine loop, its groups

    def _served(self, seeds: list[int] | None) -> None:
        """Record a generate call's seeds; past max_calls the driver loops, and the test fails at once."""
        self.served.append(list(seeds or []))
        if len(self.served) > self.max_calls:
            raise AssertionError(f"rollout worker {self.index} was asked to generate {len(self.served)} times "
                                 f"(FakeEngine.max_calls={self.max_calls}): the driver loops")

    def generate(self, prompts: list[list[int]] | list[str], group_size: int, seeds: list[int] | None = None,
                 greedy: bool = False, max_new_tokens: int | None = None) -> list[PromptRollout]:
        """`group_size` completions per prompt (token i of completion j: 10 + j), at the version it holds."""
        self._served(seeds)
        return [PromptRollout(p, list(p) if isinstance(p, list) else [1],
                              [Completion([10 + j] * self.completion_len, [-0.5] * self.completion_len, f"c{j}", "stop")
                               for j in range(group_size)], weight_version=self.weight_version)
                for p in prompts]

    def generate_multiturn(self, conversations: list[list[dict]], fields: list[dict], group_size: int,
                           seeds: list[int] | None = None, greedy: bool = False) -> list:
        """`group_size` one-turn trajectories per conversation (completion j as `generate`'s), at the version it
        holds; with `env_reset_error` set, every environment's reset() raised it: each trajectory ends before any
        turn, as actors/multiturn/trajectories.py run_trajectories ends it. (How a real engine runs the turns:
        tests/unit/test_multiturn_parts.py, tests/e2e/test_multiturn.py.)"""
        self._served(seeds)
        n = self.completion_len

        def trajectory(conversation: list[dict], j: int) -> Trajectory:
            if self.env_reset_error is not None:
                return Trajectory([1, 2], messages=list(conversation), env_error=f"reset: {self.env_reset_error}",
                                  finish_reason="env_error")
            return Trajectory([1, 2], [10 + j] * n, [1] * n, [-0.5] * n, list(conversation), f"c{j}", "stop", turns=1)

        return [MultiTurnRollout([trajectory(c, j) for j in range(group_size)], self.weight_version)
                for c in conversations]

    # trainer.mode=pipeline (actors/engine/pipeline_loop.py): groups in, finished groups out at the version held
    def pipeline_start(self) -> None:
        self.loop_running = True

    def pipeline_submit(self, groups: list[tuple[int, list[int], int]]) -> dict:
        self.pipeline_start()
        self.in_flight += list(groups)
        return {"in_flight": len(self.in_flight), "pid": self.pid}

    def pipeline_take(self) -> dict:
        self.pipeline_start()
        done, self.in_flight = self.in_flight, []
        v = self.weight_version
        rollouts = [PromptRollout(key, list(ids), [Completion([10 + j] * self.completion_len, [-0.5] * self.completion_len,
                                                              f"c{j}", "stop", versions=[v] * self.completion_len)
                                                   for j in range(g)], weight_version=v) for key, ids, g in done]
        return {"rollouts": rollouts, "stats": {}, "in_flight": 0, "weight_version": v, "pid": self.pid}

    def pipeline_stop(self) -> list[int]:
        keys, self.in_flight, self.loop_running = [key for key, _, _ in self.in_flight], [], False
        return keys

    def own_info(self) -> dict:
        return {"weight_version": self.weight_version}

    def _restarted(self) -> None:
        self.weight_version = 0  # a new vLLM process loaded the base model, with no loop running
        self.loop_running, self.in_flight = False, []
