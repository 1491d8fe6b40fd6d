"""cluster/run/health.py: each guard warns, halts after trainer.halt_after steps in a row, and can be turned off."""
from cluster.config import TrainerConfig
from cluster.run.health import HealthMonitor


def row(step, **kw):
    return {"step": step, "reward_mean": 0.5, "zero_var_groups": 0, "entropy": 1.0, "kl": 0.01,
            "logprob_diff_mean": 1e-5, "logprob_diff_max": 1e-4} | kw


def run(monitor, rows, groups=4):
    return [monitor.check(r, groups) for r in rows]


def test_healthy_steps_say_nothing():
    verdicts = run(HealthMonitor(TrainerConfig(halt_after=2), beta=0.1, mismatch_expected=False), [row(1), row(2)])
    assert all(not v.warnings and v.halt is None for v in verdicts)


def test_zero_variance_halts_after_n_consecutive_steps_only():
    m = HealthMonitor(TrainerConfig(halt_after=3), beta=0.0, mismatch_expected=False, run_dir="runs/x")
    v = run(m, [row(1), row(2, zero_var_groups=4), row(3, zero_var_groups=4), row(4, zero_var_groups=3),  # streak broken
                row(5, zero_var_groups=4), row(6, zero_var_groups=4), row(7, zero_var_groups=4)])
    assert [x.halt is None for x in v] == [True] * 6 + [False]
    assert "no learning signal" in v[1].warnings[0] and "halts at 3" in v[1].warnings[0]
    assert "for 3 consecutive steps" in v[6].halt and "reward function" in v[6].halt
    assert "raygrpo show runs/x" in v[6].halt


def test_zero_variance_never_halts_a_run_that_never_had_a_signal():
    """An untrained model on a hard task: every reward 0 from step 1. Warned at its first step and every
    halt_after steps, never halted; once a signal shows up, the guard counts as usual."""
    m = HealthMonitor(TrainerConfig(halt_after=3), beta=0.0, mismatch_expected=False, run_dir="runs/x")
    v = run(m, [row(s, zero_var_groups=4) for s in range(1, 8)])
    assert all(x.halt is None for x in v)
    warned = [s for s, x in enumerate(v, 1) if x.warnings]
    assert warned == [1, 4, 7]
    assert "no learning signal yet" in v[0].warnings[0] and "raygrpo show runs/x" in v[0].warnings[0]
    v = run(m, [row(8)] + [row(s, zero_var_groups=4) for s in range(9, 12)])
    assert [x.halt is None for x in v] == [True, True, True, False]


def test_entropy_kl_and_mismatch_guards():
    t = TrainerConfig(halt_after=1, entropy_floor=0.01, kl_ceiling=1.0, logprob_diff_ceiling=0.5, logprob_diff_warn=0.1)
    assert "policy collapsed" in HealthMonitor(t, beta=0.1, mismatch_expected=False).check(row(1, entropy=1e-4), 4).halt
    assert "ran away" in HealthMonitor(t, beta=0.1, mismatch_expected=False).check(row(1, kl=3.0), 4).halt
    assert HealthMonitor(t, beta=0.0, mismatch_expected=False).check(row(1, kl=3.0), 4).halt is None  # no KL term
    v = HealthMonitor(t, beta=0.1, mismatch_expected=False).check(row(1, logprob_diff_mean=0.2), 4)
    assert v.halt is None and "logprob_diff_mean 0.2 > trainer.logprob_diff_warn" in v.warnings[0]
    assert "dtype" in HealthMonitor(t, beta=0.1, mismatch_expected=False).check(row(1, logprob_diff_mean=2.0), 4).halt
    # processed log-probs (temperature != 1) differ from the learner's by design: not a symptom
    assert not HealthMonitor(t, beta=0.1, mismatch_expected=True).check(row(1, logprob_diff_mean=2.0), 4).warnings
    # a batch sampled by an older version (async) differs by the updates since: not a mismatch
    stale = HealthMonitor(t, beta=0.1, mismatch_expected=False).check(row(1, logprob_diff_mean=2.0, staleness=1), 4)
    assert not stale.warnings and stale.halt is None
    assert "dtype" in HealthMonitor(t, beta=0.1, mismatch_expected=False).check(
        row(1, logprob_diff_mean=2.0, staleness=0), 4).halt


def test_every_guard_can_be_turned_off():
    bad = row(1, zero_var_groups=4, entropy=0.0, kl=100.0, logprob_diff_mean=100.0)
    off = TrainerConfig(halt_after=1, halt_on_zero_variance=False, entropy_floor=0, kl_ceiling=0,
                        logprob_diff_ceiling=0, logprob_diff_warn=0)
    v = HealthMonitor(off, beta=0.1, mismatch_expected=False).check(bad, 4)
    assert v.halt is None and not v.warnings
    v = HealthMonitor(TrainerConfig(halt_after=0), beta=0.1, mismatch_expected=False).check(bad, 4)
    assert v.halt is None and len(v.warnings) == 5  # halt_after=0: warned, never halted


def test_an_environment_failing_every_trajectory_halts_with_an_environment_diagnosis():
    """Issue 30 case 5: a failing reset left no tokens, and the entropy guard said "policy collapsed".
    Steps where the environment failed every trajectory are the environment's, not the policy's."""
    m = HealthMonitor(TrainerConfig(halt_after=2), beta=0.1, mismatch_expected=False)
    broken = row(1, entropy=0.0, zero_var_groups=4, env_errors=16)
    v1, v2 = m.check(broken, 4, env_failed=True), m.check(broken | {"step": 2}, 4, env_failed=True)
    assert v1.halt is None and "environment failed every trajectory" in v1.warnings[0] and len(v1.warnings) == 1
    assert "the environment failed every trajectory (16 env_errors)" in v2.halt and "rollout.env" in v2.halt
    assert "policy collapsed" not in v2.halt and "learning signal" not in v2.halt
    assert m.streaks["entropy"] == m.streaks["zero_variance"] == 0  # the environment's steps are not counted there
    assert m.check(row(3), 4).halt is None and m.streaks["environment"] == 0  # a working step ends the streak


def demo_rows(kls, rewards):
    return [row(s, kl=k, reward_mean=r) for s, (k, r) in enumerate(zip(kls, rewards), 1)]


def test_a_single_kl_spike_in_a_learning_run_is_not_a_runaway():
    """Issue 59, item 11: the main demo warned "KL to the reference 8.16 > trainer.kl_ceiling 5: the policy ran
    away" at step 154 of a run that learned +29 points. Its shape: the reward rising, KL per token a few tenths,
    and single steps far above (k3's unbounded tail: one unlikely sampled token). Not a word, not a halt."""
    kls = [0.05 + 0.002 * s for s in range(200)]
    for step, spike in ((61, 6.3), (154, 8.16), (167, 7.6)):
        kls[step - 1] = spike
    kls[154] = 5.4  # two spikes in a row: still the median of five says 0.4
    rewards = [0.35 + 0.0015 * s for s in range(200)]
    m = HealthMonitor(TrainerConfig(halt_after=10), beta=0.001, mismatch_expected=False)
    verdicts = run(m, demo_rows(kls, rewards))
    assert [(s, v.warnings) for s, v in enumerate(verdicts, 1) if v.warnings or v.halt] == []


def test_a_kl_that_stays_over_the_ceiling_still_warns_and_halts():
    """A runaway stays over the ceiling (the halted pipeline try: 49 of 70 steps over 5, 10 in a row, median 8.48):
    the median of the last steps crosses it two steps after the KL does, is warned about every step, and halts
    after halt_after steps."""
    kls = [0.3] * 20 + [2.0 + 0.8 * s for s in range(20)]  # KL climbs past 5 at step 25 and stays
    rewards = [0.3] * 40  # the reward goes nowhere
    m = HealthMonitor(TrainerConfig(halt_after=10), beta=0.001, mismatch_expected=False)
    verdicts = run(m, demo_rows(kls, rewards))
    warned = [s for s, v in enumerate(verdicts, 1) if v.warnings]
    assert warned == list(range(27, 41)), warned  # over 5 from step 25: the median from step 27 on, every step
    assert "the policy ran away" in verdicts[26].warnings[0] and "median of the last 5 steps" in verdicts[26].warnings[0]
    assert verdicts[35].halt is not None and "for 10 consecutive steps" in verdicts[35].halt
    assert all(v.halt is None for v in verdicts[:35])
