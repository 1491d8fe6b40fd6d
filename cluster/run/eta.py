"""The time a run has left, as the progress line shows it ("eta 12.3m").

The estimate is the recent time per step times the steps left, plus the evaluations still to come
times what the last one took. Start-up (Ray, the engines, DeepSpeed, a resume) and evaluations are
never counted as step time: averaging the wall time since the start spread them over the steps,
which made early ETAs 2-3x too long (issue 37). A step's time is the wall time from the end of the
previous step to the end of this one, less any evaluation in between (so checkpoints and logging
count); the first step of a (re)started run counts its own `step_s`. The median of the last WINDOW
steps keeps one slow step (a checkpoint, a restarted engine) from swinging the estimate. Nothing is
shown until MIN_STEPS steps were timed.
"""
from __future__ import annotations

import statistics

MIN_STEPS = 3  # steps timed before an ETA is shown
WINDOW = 10  # recent steps whose median is the time per step


class EtaEstimator:
    def __init__(self, total_steps: int, eval_every: int = 0, evaluates: bool = False):
        """eval_every: trainer.eval_every (0: no evaluation between steps); evaluates: the run has held-out
        prompts, so it evaluates at the end (and every eval_every steps before it)."""
        self.total, self.eval_every, self.evaluates = total_steps, eval_every, evaluates
        self.step_times: list[float] = []
        self.last_eval_s: float | None = None
        self._last_step_end: float | None = None
        self._eval_since_step = 0.0

    def step_done(self, step: int, now: float, step_s: float) -> None:
        """Step `step` ended at `now` (a monotonic clock); step_s: its own measured time (used for the first)."""
        if self._last_step_end is None:
            took = step_s
        else:
            took = now - self._last_step_end - self._eval_since_step
        if took == took and took >= 0:  # NaN (a row without step_s) is not a time
            self.step_times = (self.step_times + [took])[-WINDOW:]
        self._last_step_end, self._eval_since_step = now, 0.0

    def eval_done(self, eval_s: float) -> None:
        """An evaluation took eval_s seconds: the next evaluations are expected to take as long."""
        self.last_eval_s = eval_s
        if self._last_step_end is not None:
            self._eval_since_step += eval_s

    def evaluations_left(self, step: int) -> int:
        """Evaluations still to run once step `step` is logged: every eval_every steps up to the last
        step (the one after step `step` itself included), then the final one."""
        if not self.evaluates:
            return 0
        between = sum(1 for k in range(step, self.total) if self.eval_every and k > 0 and k % self.eval_every == 0)
        return between + 1

    def per_step_s(self) -> float | None:
        return statistics.median(self.step_times) if len(self.step_times) >= MIN_STEPS else None

    def remaining_s(self, step: int) -> float | None:
        """Seconds left after step `step` (None until MIN_STEPS steps were timed)."""
        per_step = self.per_step_s()
        if per_step is None:
            return None
        return per_step * max(self.total - step, 0) + (self.last_eval_s or 0.0) * self.evaluations_left(step)


def format_duration(seconds: float) -> str:
    """45s, 12.3m, 2.1h"""
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"
