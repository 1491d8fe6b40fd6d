"""The driver's decisions at its seam (issue 58, item 3): the real loop (Trainer._train), collector, schedule,
rollout pool, engine weights, learner group, comebacks and step rows, over tests/fakes' actors (held to the real
ones by tests/unit/test_fake_contracts.py). What an actor does is turned on the fake (it dies, Ray restarts it
as another process, a reward function fails); what the driver decided is read where a user reads it: the rows
of metrics.jsonl, placement.json, the console, the halt's message, and the fakes' own record of the calls."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

import cluster.driver.trainer as trainer_module
from actors.rewards.scorer import REWARD_STATS
from cluster.config import RunConfig
from cluster.driver.batch import EnvironmentNotes
from cluster.driver.collector import Collector
from cluster.driver.comebacks import Comebacks
from cluster.driver.context import RunContext
from cluster.driver.engine_weights import EngineWeights, WeightVersions
from cluster.driver.placement_record import PlacementRecord
from cluster.driver.reference import ReferenceLogprobs
from cluster.driver.rollout_pool import RolloutPool
from cluster.driver.schedules import SCHEDULES
from cluster.driver.trainer import Trainer
from cluster.driver.worker_groups import LearnerGroup
from cluster.launch.waits import ActorFailed
from cluster.run.health import HealthMonitor, TrainingHalted
from cluster.run.metrics import MetricsLogger, read_metrics
from tests.fakes import FakeEngine, FakeHosts, FakeLearnerRank, FakeReference, FakeScorer, handle, use_fake_ray
from tests.fakes.ray_like import come_back, die
from tests.unit.test_collect import FakeStream

G = 2


def reward_of_completion(text: str, fields: dict) -> float:
    """The example's `rewards` field gives completion j ("c{j}") its reward."""
    return float(fields["rewards"][int(text[1:])])


def run(tmp_path, monkeypatch, *, engines=2, min_workers=1, steps=2, halt_after=3, functions=None,
        prompts=2, faults=None, reference=None, scorer=None) -> SimpleNamespace:
    """A run of `steps` sync steps over fakes: `engines` FakeEngines in the real RolloutPool, one FakeLearnerRank
    behind the real LearnerGroup, the real EngineWeights and Comebacks between them; every prompt's completions
    score 1 and 0 (a learning signal in each group). `faults`: {step: fn(run)}, run once step's update is done;
    `reference`: a FakeReference as the reference actor (its log-probs fetched while collecting); `scorer`: a real
    RewardScorer in place of the FakeScorer of `functions` (what a real reward kind says reaches the loop as is)."""
    import ray

    use_fake_ray(monkeypatch)
    monkeypatch.setattr(ray, "put", lambda obj: obj)  # LearnerGroup.train's one copy for every rank
    monkeypatch.setattr(trainer_module, "shutdown_actors", lambda actors: None)  # the run's end: nothing to kill
    monkeypatch.setattr(trainer_module, "write_plots", lambda run_dir: None)  # matplotlib's plots: not the seam
    cfg = RunConfig()
    t = cfg.trainer
    t.group_size, t.prompts_per_step, t.steps, t.halt_after, t.actor_timeout_s = G, prompts, steps, halt_after, 10.0
    cfg.rollout.num_workers, cfg.rollout.min_workers = engines, min_workers
    fleet = [FakeEngine(i, 100 + i) for i in range(engines)]
    rank = FakeLearnerRank(0, 200)
    hosts, versions, threads = FakeHosts(), WeightVersions(), {f"rollout-{i}": 1 for i in range(engines)}
    for e in fleet:
        hosts.place(f"rollout worker {e.index}", e.node_id)
    rows = [{"role": f"rollout-{e.index}", "pid": e.pid, "node_id": e.node_id} for e in fleet]
    placement = PlacementRecord(rows, tmp_path, actors=None, timeout_s=10.0)
    monkeypatch.setattr(placement, "say_network", lambda roles=None: placement.write())  # no network views asked
    learners = LearnerGroup([handle(rank)], 10.0)
    pool = RolloutPool([handle(e) for e in fleet], 10.0, lambda w, new: comebacks.engine_restarted(w, new),
                       [e.pid for e in fleet], on_rejoin=lambda w, info: comebacks.engine_up(w, info), hosts=hosts,
                       min_live=min_workers, node_wait_s=0.0, bundle={"CPU": 1})
    weights = EngineWeights(cfg, versions, "gloo", pool, learners, threads, hosts, threading.RLock())
    stream = FakeStream([[1, 0]] * (prompts * (steps + 2)))
    scorer = scorer or FakeScorer(functions or {"f": reward_of_completion})
    comebacks = Comebacks(None, placement, hosts, threads, weights, scorer, pool, 10.0)
    ctx = RunContext(cfg, tmp_path, stream, scorer, eos_id=9, env_notes=EnvironmentNotes(cfg.rollout.max_model_len),
                     actors=SimpleNamespace(reference=None, learners=[handle(rank)]), placement=placement, hosts=hosts,
                     threads=threads, lend={}, learner_params=None, learners=learners, pool=pool, versions=versions,
                     weights=weights, comebacks=comebacks, restarts=None,
                     reference=ReferenceLogprobs(handle(reference), 10.0) if reference is not None else None)
    trainer = Trainer.__new__(Trainer)  # what _setup and start_run would build, built above over the fakes
    trainer.cfg, trainer.run_dir, trainer.step, trainer.ctx, trainer.versions = cfg, tmp_path, 0, ctx, versions
    trainer.stream, trainer.scorer, trainer.heldout, trainer.pad_id = stream, scorer, None, 0
    trainer.resumed_batch, trainer.regenerated_on_resume, trainer._unrecorded = None, 0, None
    trainer.stop = SimpleNamespace(armed=False, requested=False)
    trainer.health = HealthMonitor(t, beta=0.0, mismatch_expected=False, run_dir=str(tmp_path))
    trainer.log = MetricsLogger(tmp_path, steps, tensorboard=False,
                                extra_keys=tuple(f"rewards/{name}/{stat}" for name in scorer.names.values()
                                                  for stat in REWARD_STATS))
    saved = []
    trainer.save_checkpoint = lambda finished=False, position=None: saved.append(trainer.step) or tmp_path / "ckpt"
    trainer.collector = Collector(ctx)
    trainer.schedule = SCHEDULES["sync"](ctx, trainer.collector)
    weights.update(send=False, rebuild=True)  # _setup's connect: the transfer group over the fleet
    r = SimpleNamespace(trainer=trainer, engines=fleet, rank=rank, pool=pool, placement=placement, saved=saved,
                        scorer=scorer)
    after_update = trainer.schedule.after_update

    def then_the_fault(version: int) -> None:  # the loop calls this between steps
        after_update(version)
        (faults or {}).get(trainer.step, lambda run: None)(r)

    trainer.schedule.after_update = then_the_fault
    return r


def train(r) -> list[dict]:
    """The real loop, Trainer._train, to the run's end (no held-out set: no evaluation); the rows it wrote."""
    try:
        r.trainer._train()
    finally:
        r.trainer.log.close()
    return read_metrics(r.trainer.run_dir)


# ------------------------------------------------------------------ tests
def test_the_seam_runs_a_healthy_run_every_step_trained_on_fresh_weights_and_verified(tmp_path, monkeypatch):
    r = run(tmp_path, monkeypatch, steps=3)
    rows = train(r)
    assert [row["step"] for row in rows] == [1, 2, 3] and len(r.rank.batches) == 3
    assert [row["weight_version"] for row in rows] == [1, 2, 3] and all(row["staleness"] == 0 for row in rows)
    assert all(row["sync_verified"] is True for row in rows) and [e.weight_version for e in r.engines] == [3, 3]
    assert all(row["rollout/live_engines"] == 2 and row["rollout_restarts"] == 0 for row in rows)


@pytest.mark.timeout(60)  # a restart never re-synced is revived for ever (FakeEngine.max_calls stops it first)
def test_an_engine_ray_restarts_as_a_new_process_is_resynced_and_verified_before_its_prompts_go_again(
        tmp_path, monkeypatch, capsys):
    """Engine 0 dies after step 1; Ray restarts it as pid 777 with the base weights. The pool revives it in the
    call that failed: its threads, placement.json, the transfer group rebuilt with the new process, weights
    version 1 sent and verified, and only then its share generated again, so step 2 trains on no stale token."""
    r = run(tmp_path, monkeypatch, steps=3, faults={1: lambda run: die(run.engines[0], comes_back_as=777)})
    rows = train(r)
    assert [row["rollout_restarts"] for row in rows] == [0, 1, 1] and all(row["staleness"] == 0 for row in rows)
    assert all(row["sync_verified"] is True for row in rows) and [e.weight_version for e in r.engines] == [3, 3]
    said = capsys.readouterr().out
    assert "rollout worker 0 restarted as a new process (pid 100 -> 777); re-syncing weights version 1" in said
    assert r.engines[0].threads == 1 and r.rank.engine_pids == [777, 101]  # the new process is in the group
    assert next(p for p in r.placement if p["role"] == "rollout-0")["pid"] == 777
    assert len(r.engines[0].served) == 3  # one answered call a step: the call that failed never ran


@pytest.mark.timeout(60)
def test_an_engine_restarted_between_calls_answers_stale_and_is_resynced_before_its_answer_is_used(
        tmp_path, monkeypatch, capsys):
    """Ray restarted engine 1 while nothing was asked of it: its next answer carries weight version 0 where
    the driver expects 1. That answer is not used: the engine is re-synced (verified) and asked again."""
    r = run(tmp_path, monkeypatch, steps=2, faults={1: lambda run: come_back(run.engines[1], 555)})
    rows = train(r)
    assert [row["rollout_restarts"] for row in rows] == [0, 1] and [row["staleness"] for row in rows] == [0, 0]
    assert "rollout worker 1 restarted as a new process (pid 101 -> 555)" in capsys.readouterr().out
    assert r.rank.engine_pids == [100, 555] and r.engines[1].weight_version == 2


def test_an_engine_dead_past_rollout_max_restarts_leaves_the_fleet_until_rollout_min_workers(
        tmp_path, monkeypatch, capsys):
    """Issue 59 item 3 at the seam: engine 2 dies for good after step 1 (Ray's DEAD: its restart budget spent).
    Step 2's generation finds it: it leaves the fleet, its prompt is served by the others, and the transfer group
    is rebuilt without it before the update (which does not fail first). The run goes on with 2 of 3 engines
    (rollout.min_workers=2); when engine 1 dies too, the run fails naming rollout.min_workers."""
    r = run(tmp_path, monkeypatch, engines=3, min_workers=2, steps=4, prompts=3,
            faults={1: lambda run: die(run.engines[2]), 3: lambda run: die(run.engines[1])})
    with pytest.raises(ActorFailed, match=r"fewer than rollout.min_workers=2 engine\(s\) would generate"):
        train(r)
    rows = read_metrics(tmp_path)
    assert [row["rollout/live_engines"] for row in rows] == [3, 2, 2] and len(r.rank.batches) == 3
    assert all(row["staleness"] == 0 and row["sync_verified"] is True for row in rows)
    said = capsys.readouterr().out
    assert "rollout worker 2 left the fleet (died for good" in said
    assert "to the rollout engines failed" not in said  # rebuilt before the next update, not after it failed
    assert [h.actor.index for h in r.rank.engines] == [0, 1]  # the transfer group without it
    assert [e.weight_version for e in r.engines] == [3, 3, 1]
    assert [len(b.prompt_ids) for b in r.rank.batches] == [3 * G] * 3  # every step trained all 3 prompts' groups


def test_an_engine_dead_with_no_share_of_the_step_is_found_by_the_update_which_goes_again_without_it(
        tmp_path, monkeypatch, capsys):
    """2 prompts over 3 engines: engine 2 generates nothing at step 2, so its death (for good) is found by the
    weight update. The engines are checked, it leaves the fleet, and the update goes again to the other two,
    verified: the step is not lost and the learner is not restarted."""
    r = run(tmp_path, monkeypatch, engines=3, min_workers=2, steps=3, prompts=2,
            faults={1: lambda run: die(run.engines[2])})
    rows = train(r)
    assert [row["rollout/live_engines"] for row in rows] == [3, 2, 2] and len(r.rank.batches) == 3
    assert all(row["sync_verified"] is True for row in rows) and [e.weight_version for e in r.engines] == [3, 3, 1]
    said = capsys.readouterr().out
    assert "sending weights version 2 to the rollout engines failed" in said and "it goes again (2/4)" in said
    assert "rollout worker 2 left the fleet (died for good" in said


def test_a_reward_function_failing_alone_is_left_out_then_the_guard_saves_a_checkpoint_before_it_halts(
        tmp_path, monkeypatch):
    """Function b fails every call (a verifier answering 500); a still scores. Each sample's reward is a's, its
    weight renormalised over the functions that scored (1+1)/1 = 2: the rewards of a group are 2 and 0, never
    a's plus 0 for b. Training goes on; after trainer.halt_after=2 such steps the guard halts, the checkpoint
    of the last step saved first, the message naming b."""
    r = run(tmp_path, monkeypatch, steps=5, halt_after=2,
            functions={"a": reward_of_completion, "b": lambda text, fields: 0.5})
    r.scorer.failing = {"b"}
    with pytest.raises(TrainingHalted, match=r"(?s)\bb\b.*Checkpoint .*ckpt was saved") as halt:
        train(r)
    rows = read_metrics(tmp_path)
    assert [row["step"] for row in rows] == [1, 2] and r.saved == [2] and len(r.rank.batches) == 2
    assert [row["reward_mean"] for row in rows] == [1.0, 1.0]  # (2 + 0) / 2, b left out, a's weight renormalised
    assert all(row["rewards/b/errors"] == 4 and row["update_skipped"] is False for row in rows)
    assert "reward function b" in str(halt.value)


def test_the_step_row_says_the_update_was_verified_only_when_the_learner_says_so(tmp_path, monkeypatch):
    """sync_verified is what the update's sender reported (every engine's fingerprint matched), not a constant:
    a sender that did not check says False in every row (issue 58's planted-bug gap: the row's value hard-coded
    true was caught by no test)."""
    r = run(tmp_path, monkeypatch, steps=2)
    r.rank.verifies = False
    rows = train(r)
    assert [row["sync_verified"] for row in rows] == [False, False] and all(row["sync_bytes"] > 0 for row in rows)


def test_a_step_that_sent_no_update_has_no_sync_verified(tmp_path, monkeypatch):
    """The only reward function fails every call: nothing to train on, no update sent; the row's sync_verified is
    null (not true), and the guard halts at once after it."""
    r = run(tmp_path, monkeypatch, steps=3)
    r.scorer.failing = {"f"}
    with pytest.raises(TrainingHalted, match="no reward function scored any sample at step 1"):
        train(r)
    [row] = read_metrics(tmp_path)
    assert row["update_skipped"] is True and row["sync_verified"] is None and r.rank.batches == []


def test_the_reference_actors_log_probs_reach_the_learner_with_the_batch_and_its_death_is_named(tmp_path, monkeypatch):
    """The reference actor's log-probs, one per completion token, are fetched while collecting and trained with;
    a reference actor that died fails the step naming it (cluster/driver/reference.py, without its RestartWatch)."""
    ref = FakeReference(logprob=-0.25)
    r = run(tmp_path, monkeypatch, steps=2, reference=ref, faults={1: lambda run: die(ref)})
    with pytest.raises(ActorFailed, match="reference actor .*computing reference log-probs"):
        train(r)
    [batch] = r.rank.batches
    assert batch.ref_logp == [[-0.25, -0.25]] * (2 * G) and ref.asked == [2 * G]
