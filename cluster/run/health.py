"""Training health, watched after every step: warn about what looks wrong, halt on what stays wrong.

Each guard reads the step's metrics row. A condition that holds for `trainer.halt_after`
consecutive steps halts the run: the driver saves a checkpoint first, then raises
`TrainingHalted` with a diagnosis (the likely cause and what to change). Every threshold lives
in `TrainerConfig` (cluster/config.py); 0 turns a guard off. A guard that trips at the run's
last step does not halt it: the run ends as usual, with a warning (Trainer._check_health).

The zero-variance guard counts only after the first step with any learning signal (a group whose
rewards differ): it halts a run that *lost* its signal for `halt_after` steps in a row (the policy
collapsed onto answers that all score the same). A run that never had one (an untrained model on
a hard task: every GSM8K answer wrong) is warned about, at its first step and every `halt_after`
steps, but goes on: sampling may still find a rewarded answer, and the completions it logs
(`raygrpo show RUN_DIR`) tell a constant reward from a hard task. The other rule, "not before an
evaluation has run", was not taken: evaluations are optional (data.num_eval=0, trainer.eval_every=0)
and the one before training always runs first, so it would mean "always" or "never".

The KL guard reads the median of the last KL_WINDOW steps' KL, not the step's own (issue 59, item 11). The
logged `kl` is a per-token mean of k3 = r - log r - 1, r = pi_ref(y_t) / pi_theta(y_t), which is unbounded in r:
one sampled token the policy now finds unlikely (pi_theta 1e-4) and the reference likely (0.5) adds
r ~ 5000 / (tokens in the batch), about +2.4 nats per token to a 2048-token step. Learning runs do show
single-step spikes over the ceiling between steps of KL 0.3: the main demo 8.16 at step 154 of a run that
learned +29 points, the pipeline recipe 7.6 at step 167 (median 0.27) and 3-4 single steps in runs of +28 and
+31 (docs/benchmarks.md). A policy that ran away stays there: the one the guard halted had 49 of 70 steps over
5, 10 in a row, median 8.48. The median of 5 ignores up to two spikes in five and follows a sustained rise
two steps late.

Reward functions fail alone (actors/rewards/scorer.py): a function that failed every call of a step
is warned about and the step goes on with the others; it halts the run when it failed every call
for `halt_after` steps in a row. A step where no function scored any sample halts at once (there
is nothing to learn from; `halt_after` 0 included). Either halt names exactly the functions that
failed, each with its error count and first error.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

KL_WINDOW = 5  # steps whose median KL the KL guard reads (the module docstring says why)


class TrainingHalted(RuntimeError):
    """The run was stopped by a health guard (after a checkpoint); the message is the diagnosis."""


@dataclass
class Verdict:
    warnings: list[str] = field(default_factory=list)
    halt: str | None = None  # the diagnosis when the run must stop


def _finite(row: dict, key: str) -> float | None:
    v = row.get(key)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


class HealthMonitor:
    def __init__(self, trainer_cfg, *, beta: float, mismatch_expected: bool, run_dir: str = "RUN_DIR"):
        """mismatch_expected: the behaviour log-probs are not the raw policy's (vLLM's processed_logprobs
        with temperature / top-p / top-k), so the learner-vs-vLLM gap says nothing about a bug."""
        self.t, self.beta, self.mismatch_expected, self.run_dir = trainer_cfg, beta, mismatch_expected, run_dir
        # "environment" first: when it and another guard trip together, the environment is the cause
        self.streaks = {"environment": 0, "zero_variance": 0, "entropy": 0, "kl": 0, "mismatch": 0}
        self.signal_seen = False  # a step had a group whose rewards differ (the zero-variance guard counts from then)
        self.no_signal_steps = 0  # steps without any signal before the first one
        self.failing: dict[str, int] = {}  # reward function -> steps in a row it failed every call
        self.recent_kl: deque[float] = deque(maxlen=KL_WINDOW)  # the last steps' KL, whose median the guard reads

    def check(self, row: dict, scored_groups: int, env_failed: bool = False, unscored: bool = False,
              reward_errors: dict[str, str] | None = None, failed_functions: list[str] = ()) -> Verdict:
        """env_failed: every trajectory of the step ended on an environment error (multi-turn).
        unscored: no reward function scored any sample of the step. reward_errors: every function with an
        error in the step -> what to say of it (cluster.driver.batch.CollectStats.function_errors);
        failed_functions: those that failed every call."""
        t, v = self.t, Verdict()
        self.streaks["environment"] = self.streaks["environment"] + 1 if env_failed else 0
        if env_failed:
            # The step says nothing about the policy (no trajectory got past the environment): the other
            # guards skip it, so a broken environment is not diagnosed as a collapsed policy.
            n = self.streaks["environment"]
            v.warnings.append(f"step {row['step']}: {self._symptom('environment', row, scored_groups)} ({n} step(s) "
                              "in a row" + (f"; the run halts at {t.halt_after})" if t.halt_after else ")"))
            if t.halt_after and n >= t.halt_after:
                v.halt = f"{self._symptom('environment', row, scored_groups)} for {n} consecutive steps. " \
                         f"{self._advice('environment')}"
            return v
        if self._rewards(v, row["step"], unscored, reward_errors or {}, failed_functions):
            return v  # nothing was scored: the other guards have nothing to read
        no_signal = scored_groups > 0 and row.get("zero_var_groups", 0) >= scored_groups
        self.signal_seen = self.signal_seen or (scored_groups > 0 and not no_signal)
        if no_signal and not self.signal_seen and t.halt_on_zero_variance:
            self.no_signal_steps += 1
            if (self.no_signal_steps - 1) % max(t.halt_after, 1) == 0:  # the first such step, then every halt_after
                v.warnings.append(f"step {row['step']}: no learning signal yet ({self.no_signal_steps} step(s)): "
                                  f"{self._symptom('zero_variance', row, scored_groups)}. The run goes on (the "
                                  "zero-variance guard halts only a run that had a signal and lost it); look at what "
                                  f"the model writes and how it is scored: `raygrpo show {self.run_dir}`")
        entropy, diff = _finite(row, "entropy"), _finite(row, "logprob_diff_mean")
        kl = self._kl_median(row)
        # The gap says something about the engines only when they sampled with the weights the learner
        # holds: a batch from an older version (the async schedule) differs by the updates since.
        if self.mismatch_expected or row.get("staleness", 0) > 0:
            diff = None
        unhealthy = {
            "zero_variance": t.halt_on_zero_variance and no_signal and self.signal_seen,
            "entropy": t.entropy_floor > 0 and entropy is not None and entropy < t.entropy_floor,
            "kl": t.kl_ceiling > 0 and self.beta > 0 and kl is not None and kl > t.kl_ceiling,
            "mismatch": t.logprob_diff_ceiling > 0 and diff is not None and diff > t.logprob_diff_ceiling,
        }
        if t.logprob_diff_warn > 0 and diff is not None and diff > t.logprob_diff_warn:
            v.warnings.append(f"step {row['step']}: learner and vLLM disagree on the sampled tokens' log-probs: "
                              f"logprob_diff_mean {diff:.3g} > trainer.logprob_diff_warn {t.logprob_diff_warn:g} "
                              f"(max {row.get('logprob_diff_max')})")
        for name, bad in unhealthy.items():
            self.streaks[name] = self.streaks[name] + 1 if bad else 0
            if bad:
                v.warnings.append(f"step {row['step']}: {self._symptom(name, row, scored_groups)} "
                                  f"({self.streaks[name]} step(s) in a row"
                                  + (f"; the run halts at {t.halt_after})" if t.halt_after else ")"))
        if t.halt_after and v.halt is None:
            for name, n in self.streaks.items():
                if n >= t.halt_after:
                    advice = self._advice(name).replace("RUN_DIR", self.run_dir)
                    v.halt = f"{self._symptom(name, row, scored_groups)} for {n} consecutive steps. {advice}"
                    break
        return v

    def _kl_median(self, row: dict) -> float | None:
        """The median KL of the last KL_WINDOW steps, this one included (None while no step logged a finite KL)."""
        kl = _finite(row, "kl")
        if kl is not None:
            self.recent_kl.append(kl)
        return statistics.median(self.recent_kl) if self.recent_kl else None

    def _rewards(self, v: Verdict, step: int, unscored: bool, errors: dict[str, str], failed: list[str]) -> bool:
        """The reward-function guard (see the module docstring); True when the step had no score at all."""
        t = self.t
        self.failing = {name: self.failing.get(name, 0) + 1 for name in failed}
        if unscored:
            said = "; ".join(errors.values()) or "no error was reported"
            v.halt = (f"no reward function scored any sample at step {step} (each got reward.fallback): {said}. "
                      "What to change: fix those functions (the 'reward: ...' lines above say what each one "
                      "answered), raise their timeout if they are only slow, or remove them from reward.functions; "
                      "nothing was trained at this step.")
            return True
        for name in failed:
            v.warnings.append(f"step {step}: {errors.get(name, name)}; the step went on with the other reward functions, "
                              f"their weights renormalised ({self.failing[name]} step(s) in a row"
                              + (f"; the run halts at {t.halt_after})" if t.halt_after else ")"))
        tripped = [name for name in failed if t.halt_after and self.failing[name] >= t.halt_after]
        if tripped:
            v.halt = (f"{len(tripped)} reward function(s) failed every call for {t.halt_after} consecutive steps: "
                      f"{'; '.join(errors.get(name, name) for name in tripped)}. The other functions scored the "
                      "steps, but these add nothing. What to change: fix them (the 'reward: ...' lines above say "
                      "what each one answered), raise their timeout if they are only slow, or remove them from "
                      "reward.functions; trainer.halt_after=0 lets the run go on without them.")
        return False

    def _symptom(self, name: str, row: dict, groups: int) -> str:
        return {
            "environment": f"the environment failed every trajectory ({row.get('env_errors')} env_errors): no "
                           "trajectory got past its failing call",
            "zero_variance": f"every group ({groups}) got equal rewards for all its completions: no learning signal "
                             f"(reward_mean {row.get('reward_mean')})",
            "entropy": f"token entropy {row.get('entropy'):.3g} < trainer.entropy_floor {self.t.entropy_floor:g}: "
                       "the policy collapsed" if _finite(row, "entropy") is not None else "",
            "kl": f"KL to the reference {statistics.median(self.recent_kl or [math.nan]):.3g} (per token, the median of "
                  f"the last {len(self.recent_kl)} steps; this step {row.get('kl')}) > trainer.kl_ceiling "
                  f"{self.t.kl_ceiling:g}: the policy ran away",
            "mismatch": f"learner-vs-vLLM log-prob gap {row.get('logprob_diff_mean')} > trainer.logprob_diff_ceiling "
                        f"{self.t.logprob_diff_ceiling:g}",
        }[name]

    @staticmethod
    def _advice(name: str) -> str:
        return {
            "environment": "Likely cause: the environment's code (rollout.env) raises, hangs past "
                           "rollout.env_timeout_s, or returns something outside the contract (the "
                           "'environment: ... first:' lines above show its error). What to change: fix the "
                           "environment (call its reset() and step() by hand on a dataset row), or raise "
                           "rollout.env_timeout_s if it is only slow; the policy is not the problem.",
            "zero_variance": "Likely cause: the policy collapsed onto answers that all score the same, or the reward "
                             "function gives the same value to every completion (a constant or a bug: look at the "
                             "completions with `raygrpo show RUN_DIR`), or the task is far too hard or too easy for the "
                             "model. What to change: fix reward.functions, use data of the right difficulty, raise "
                             "rollout.temperature or trainer.group_size for more varied completions, or set "
                             "trainer.dynamic_sampling=true; trainer.halt_on_zero_variance=false turns this guard off.",
            "entropy": "Likely cause: too large updates (learner.lr, learner.mu) with no anchor. What to change: lower "
                       "learner.lr, raise algo.beta, use DAPO clip-higher (algo.clip_high > algo.clip_low), or resume "
                       "from an earlier checkpoint (checkpoint.resume=PATH); trainer.entropy_floor=0 turns this off.",
            "kl": "Likely cause: learner.lr too high or algo.beta too small for this reward. What to change: lower "
                  "learner.lr or learner.mu, raise algo.beta; trainer.kl_ceiling=0 turns this guard off.",
            "mismatch": "Likely cause: the engines do not hold the learner's weights (check sync_bytes and "
                        "weight_version in metrics.jsonl), or the two sides compute in different precision "
                        "(rollout.dtype vs learner.dtype). What to change: use the same dtype on both sides, keep "
                        "algo.tis_cap set; trainer.logprob_diff_ceiling=0 turns this guard off.",
        }[name]
