"""The driver loop: one GRPO step is generate -> score -> reference -> advantages -> train -> sync.

Every schedule shares this code: how a batch is made (sync: collected, then trained on; async: step k+1
collected while step k trains; pipeline: engines that never stop) is the schedule's, behind one seam
(cluster/driver/schedules/, chosen by trainer.mode). The loop asks it for the next batch, trains on it,
sends the weights, tells it so, and checkpoints what it says to.
"""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from actors.transport.fingerprint import SyncMismatch
from cluster.config import ConfigError, RunConfig, save_config
from cluster.data.model_check import checkpoint_model_problems
from cluster.driver import checkpoints
from cluster.driver.batch import Batch
from cluster.driver.collector import Collector
from cluster.driver.context import RunContext
from cluster.driver.engine_weights import WeightVersions
from cluster.driver.placement_record import actor_name
from cluster.driver.schedules import SCHEDULES, CheckpointParts, Schedule
from cluster.driver.startup import load_inputs, start_run
from cluster.driver.step_row import step_row
from cluster.driver.worker_groups import Stopwatch
from cluster.launch.placement import Actors, restart_learners, shutdown_actors, wait_ready
from cluster.launch.waits import HOST_DEATH_WAIT_S, ActorFailed, wait_dead, wait_for
from cluster.run import logs
from cluster.run.health import HealthMonitor, TrainingHalted
from cluster.run.metrics import MFU_KEY, MetricsLogger, first_eval, write_plots
from cluster.run.resume import ResumePoint, finished_run, resume_point
from cluster.run.rundir import claim
from cluster.run.stopping import RunStopped, StopSignals
from learner import checkpoint
from learner.batch import TrainBatch


class Trainer:
    ctx: RunContext | None = None  # what start-up built once the actors are up (cluster/driver/context.py); in _setup
    schedule: Schedule | None = None  # how batches are made (trainer.mode; cluster/driver/schedules/), made in _setup
    collector: Collector | None = None  # the rollout side: a step's batch (sync, async), the evaluation; in _setup
    saved_step = 0  # the step of the last checkpoint this run saved or resumed from
    # (batch, metrics, stopwatch, start) of a step the learner trained whose row is not logged yet (its weight update
    # runs): a failure there saves it as trained (_save_before_failing)
    _unrecorded: tuple | None = None
    _step_t0 = 0.0  # when the step being trained started (its row's step_s; tests wrap _learn(batch, sw))
    failure_checkpoint: Path | None = None  # saved by _save_before_failing (it records the prompts in flight)

    def __init__(self, cfg: RunConfig, overwrite: bool = False):
        """overwrite: start afresh even if the run dir holds another run (moved aside, see cluster/run/rundir.py)."""
        self.cfg, self.overwrite = cfg, overwrite
        t = cfg.trainer
        self.run_dir = Path(t.run_dir)
        self.ckpt_root = self.run_dir / "checkpoints"
        # the tokenizer, the data and the reward functions, checked before any actor starts
        self.inputs = inputs = load_inputs(cfg)
        self.tokenizer, self.heldout, self.stream, self.scorer = inputs.tokenizer, inputs.heldout, inputs.stream, inputs.scorer
        self.resume_from = ResumePoint()  # where the run (re)starts: read before any actor starts
        self.log: MetricsLogger | None = None
        self.step = 0
        self.versions = WeightVersions()  # the learner's weight version (moved by _learn and _resume) and the engines'
        self.resumed_batch: Batch | None = None  # the next step's batch, from an async run's checkpoint
        self.regenerated_on_resume = 0  # pipeline: the groups in flight at the checkpoint resumed from (generated again)
        self.learner_restarts = 0
        # An engine must not serve a generate between the calls of a weight update (vLLM holds mixed
        # weights then): the collector holds this lock around each generate, the sync around itself.
        self._engines_lock = threading.RLock()
        self.stop = StopSignals(t.stop_grace_s)
        r = cfg.rollout
        self.health = HealthMonitor(t, beta=cfg.algo.beta, mismatch_expected=r.logprobs_mode == "processed_logprobs"
                                    and (r.temperature != 1.0 or r.top_p < 1.0 or r.top_k != -1), run_dir=str(self.run_dir))

    # ------------------------------------------------------------------ the story of a run
    def run(self) -> dict:
        run_dir_lock = claim(self.cfg, self.overwrite)  # refuses a run dir another run holds or cannot share
        try:
            start = resume_point(self.cfg)
            if start.path is not None:  # a checkpoint of another model: refused before anything is written
                problems = checkpoint_model_problems(start.path, self.cfg.model.path, checkpoint.HF_META_DIR,
                                                     lora=self.cfg.learner.lora, beta=self.cfg.algo.beta)
                if problems:
                    raise ConfigError(problems, "checkpoint.resume")
            save_config(self.cfg, self.run_dir / "config.yaml")
            done = finished_run(self.cfg, start)
            if done is not None:
                return done
            while True:
                try:
                    self._open_log()  # before any actor: where to resume, and the run dir takes writes
                    self._setup()
                    return self._train()
                except ActorFailed as e:
                    if not (e.died and e.actor.startswith("learner")):
                        self._save_before_failing(e)  # the learner lives: its steps are not lost with the run
                        raise
                    if self.learner_restarts >= self.cfg.trainer.max_learner_restarts:
                        raise
                    self.learner_restarts += 1
                    if self.schedule is not None:
                        self.schedule.stop()
                    budget = f"({self.learner_restarts}/{self.cfg.trainer.max_learner_restarts})"
                    if self._engines_outlive_learners(e.actor):
                        print(f"{e}; restarting the learner ranks and resuming from the last checkpoint {budget}; "
                              f"the {len(self.ctx.pool.live)} live rollout engine(s) and the other actors are kept", flush=True)
                    else:
                        print(f"{e}; restarting every actor and resuming from the last checkpoint {budget}", flush=True)
                        self._teardown()
                except (RunStopped, TrainingHalted, ConfigError):
                    raise  # a stop's and a halt's checkpoint is saved where they are raised; bad input has no steps
                except Exception as e:
                    self._save_before_failing(e)  # an engine's wait past trainer.actor_timeout_s, the feeder's error
                    raise
        except ActorFailed:
            logs.point_at_actor_logs(self.run_dir)  # their tracebacks went to the log files, not the console
            raise
        finally:
            self.stop.restore()
            try:  # stopping on a signal: the engines' loops get what is left of trainer.stop_grace_s, no more
                if self.schedule is not None:
                    self.schedule.stop(self.stop.grace_left() if self.stop.requested else None,
                                       recorded=isinstance(sys.exc_info()[1], RunStopped)  # its checkpoint just saved
                                       or self.failure_checkpoint is not None)
            except Exception as e:  # noqa: BLE001 - the run's own error (if any) is the one to raise
                print(f"{self.cfg.trainer.mode}: stopping the generation failed ({type(e).__name__}: {e})", flush=True)
            self._teardown()
            run_dir_lock.release()
            logs.tidy(self.run_dir)
            self.scorer.close()
            if self.log is not None:
                self.log.close()

    def _open_log(self) -> None:
        """The resume point and the metrics logger (which restores rows the file lost from that
        checkpoint's copy). TensorBoard and metrics.jsonl write here, so a full disk is named before
        any actor starts."""
        cfg = self.cfg
        wandb_run = None
        if self.log is not None:  # a restart after a dead learner rank: the same W&B run goes on
            wandb_run = self.log.detach_wandb()
            self.log.close()
        self.resume_from = resume_point(cfg, restarting=self.learner_restarts > 0)
        self.log = MetricsLogger(self.run_dir, cfg.trainer.steps, self.resume_from.step, wandb_run=wandb_run,
                                 tensorboard=cfg.metrics.tensorboard, wandb_init=cfg.metrics.wandb_init(),
                                 config=cfg.to_dict(), show_staleness=cfg.trainer.mode != "sync",
                                 show_kl=cfg.algo.beta > 0, carried_rows=self.resume_from.carried_rows(),
                                 extra_keys=(*self.scorer.metric_keys(), *((MFU_KEY,) if cfg.metrics.peak_tflops else ())),
                                 eval_every=cfg.trainer.eval_every, evaluates=bool(self.heldout))

    @property
    def version(self) -> int:
        """The learner's weight version: the number of updates trained so far (WeightVersions.learner)."""
        return self.versions.learner

    @version.setter
    def version(self, value: int) -> None:
        self.versions.learner = value

    def _train(self) -> dict:
        cfg, t = self.cfg, self.cfg.trainer
        # resumed: the evaluation before training is the one the first run logged at step 0
        before = (self.evaluate() if self.step == 0 else first_eval(self.run_dir)) if self.heldout else None
        self.stop.armed = True  # from here a stop signal waits for the step boundary (and a checkpoint)
        self.schedule.start(self.resumed_batch, self.regenerated_on_resume)
        self.resumed_batch, self.regenerated_on_resume = None, 0
        while self.step < t.steps:
            sw, t0 = Stopwatch(), time.perf_counter()
            with sw("wait_gen"):
                batch, extra = self.schedule.next_batch(self.step)
            self._step_t0 = t0
            row = self._record_step(batch, self._learn(batch, sw), sw, t0, extra)
            self.schedule.after_update(self.version)
            self.ctx.comebacks.reward_models_back()
            self._check_health(row, batch)
            if self.stop.requested:
                raise RunStopped(self.stop.signum, self.step, str(self.save_checkpoint()))
            if t.eval_every and self.step % t.eval_every == 0 and self.step < t.steps and self.heldout:
                self.evaluate()
            if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0 and self.step < t.steps:
                self.save_checkpoint()
        self.schedule.stop(recorded=True)  # before the evaluation (its generate needs idle engines) and the final checkpoint
        after = self.evaluate() if self.heldout else None
        final = self.save_checkpoint(finished=True)
        self.ctx.learners.export_hf(str(self.run_dir / "hf_model"))
        reward_model_restarts, rollout_restarts = self.scorer.restarts, self.ctx.pool.restarts
        self._teardown()
        write_plots(self.run_dir)
        return {"run_dir": str(self.run_dir), "before": before, "after": after, "checkpoint": str(final),
                "hf_model": str(self.run_dir / "hf_model"), "rollout_restarts": rollout_restarts,
                "reward_model_restarts": reward_model_restarts}

    def _check_health(self, row: dict, batch: Batch) -> None:
        """Warn about an unhealthy step; after trainer.halt_after in a row, checkpoint and halt with a diagnosis."""
        s = batch.stats
        verdict = self.health.check(row, s.groups, env_failed=s.every_trajectory_failed(), unscored=s.every_group_failed(),
                                    reward_errors=s.function_errors(self.scorer.timeout_setting),
                                    failed_functions=s.failed_functions())
        for w in verdict.warnings:
            self.log.note(f"health: {w}")
        if verdict.halt and self.step >= self.cfg.trainer.steps:  # nothing left to save by halting: end as usual
            self.log.note(f"health: WARNING: {verdict.halt} This was the run's last step, so the run ends normally "
                          "(final evaluation, checkpoint, hf_model/).")
        elif verdict.halt:
            path = self.save_checkpoint()
            write_plots(self.run_dir)
            raise TrainingHalted(f"{verdict.halt} Checkpoint {path} was saved; metrics, plots and sample completions "
                                 f"(`raygrpo show {self.run_dir}`) are in {self.run_dir}.")

    def evaluate(self) -> dict:
        """The held-out evaluation (Collector.evaluate), said as it starts and logged at this step with its cost."""
        k, last = self.cfg.trainer.eval_pass_k, self.log.eta.last_eval_s
        self.log.note(f"evaluating at step {self.step}: {len(self.heldout)} held-out prompts, greedy"
                      + (f" + pass@{k} ({k} samples each)" if k else "")
                      + (f"; the last evaluation took {last:.1f}s" if last is not None else ""))
        m = self.collector.evaluate(self.heldout, self.step)
        self.log.log_eval(self.step, m)
        return m

    def _record_step(self, batch: Batch, m: dict, sw: Stopwatch, t0: float, extra: dict | None = None) -> dict:
        """The step the learner just trained counted, its row (with `extra`, the pipeline's engine metrics) and
        completions logged; the row returned."""
        self.step += 1
        self._unrecorded = None
        sw.t["step_s"] = time.perf_counter() - t0
        row = step_row(self.cfg, batch, m, sw, step=self.step, version=self.version, pool=self.ctx.pool,
                       learner_params=self.ctx.learner_params) | (extra or {})
        self.log.log_step(row)
        self.log.log_completions(self.step, batch.stats.samples)
        return row

    def _learn(self, batch: Batch, sw: Stopwatch) -> dict:
        """Steps 4-6: the DeepSpeed update with the batch's advantages (with reference.placement=learner
        the ranks compute the reference log-probs in it), the weight broadcast."""
        # dynamic sampling found no group with a learning signal, or no reward function scored any sample
        # (the health guard halts after this step's row): nothing to train on
        if not batch.examples or batch.stats.every_group_failed():
            return {"skipped": True}
        if batch.ref_logp is not None:  # the reference actor ran while the batch was collected
            sw.t["ref_s"] = batch.stats.ref_s
        with sw("train"):
            m = self.ctx.learners.train(TrainBatch(
                prompt_ids=batch.prompt_ids, completion_ids=batch.completion_ids, advantages=batch.advantages,
                behavior_logp=batch.behavior_logp, ref_logp=batch.ref_logp, pad_id=self.pad_id,
                max_new_tokens=self.cfg.rollout.model_token_cap(), loss_mask=batch.loss_mask))
        if m.get("ref_seconds"):  # computed on the learner ranks, inside the train call
            sw.t["ref_s"], sw.t["train_s"] = m["ref_seconds"], sw.t["train_s"] - m["ref_seconds"]
        self._unrecorded = (batch, m, sw, self._step_t0)  # trained: a failure of the update below keeps the step
        with sw("sync"):
            self.version += 1
            m["sync"] = self._sync_weights()
        return m

    def _sync_weights(self) -> dict:
        """Broadcast the learner's weights (verified); an engine that fails it costs only the update
        (cluster/driver/engine_weights.py)."""
        try:
            return self.ctx.weights.update()
        except SyncMismatch as e:  # an engine holds other weights than the learner's: stop before sampling
            raise TrainingHalted(f"step {self.step + 1}: {getattr(e, 'cause', None) or e} Metrics and "
                                 f"checkpoints so far are in {self.run_dir}.") from None

    # ------------------------------------------------------------------ actors, checkpoints
    @property
    def actors(self) -> Actors | None:
        """Every actor's handle (the run context's; None before _setup and after _teardown)."""
        return self.ctx.actors if self.ctx is not None else None

    @property
    def placement(self):
        """placement.json as the run keeps it (cluster/driver/placement_record.py)."""
        return self.ctx.placement

    def _engines_outlive_learners(self, dead: str) -> bool:
        """After learner rank `dead` died: whether the engines can be kept for the restart (they hold no learner
        state). The generation under way ends first (its engines answer, or fail, within their timeouts);
        engines whose host was lost leave the fleet (below rollout.min_workers this waits for room, or raises)."""
        if self.ctx is None:
            return False
        self.schedule.settle()
        rank, pool = dead.removeprefix("learner rank "), self.ctx.pool
        if rank.isdigit():  # Ray may call it unavailable (its socket closed) before its host is known dead:
            wait_dead(self.actors.learners[int(rank)], dead, HOST_DEATH_WAIT_S)  # then the lost host is said and waited for
        for w in pool.lost_with_host():
            pool.leave(w)
        return bool(pool.live)

    def _restart_learners(self) -> None:
        """New learner ranks, each on its node or, where that was lost, on a live node with room (waiting, at
        most ray.node_wait_s, for one), the engines and the other actors kept; the weights reach the engines in
        _resume, from the checkpoint (or the base model)."""
        cfg, ctx = self.cfg, self.ctx
        restart_learners(ctx.actors, cfg, ctx.hosts)
        infos = wait_ready(Actors(learners=ctx.actors.learners), cfg.trainer.actor_timeout_s)
        for info in infos:
            ctx.hosts.place(actor_name(info), info.get("node_id"))
            wait_for(ctx.actors.learners[info["rank"]].set_threads.remote(ctx.threads[info["role"]]), actor_name(info),
                     "setting its threads", cfg.trainer.actor_timeout_s)
            ctx.placement.row(info["role"]).update({**info, "threads": ctx.threads[info["role"]]})
        ctx.placement.say_network([info["role"] for info in infos])
        ctx.learners.use(ctx.actors.learners)  # the group every part holds now calls the new ranks
        ctx.weights.update(send=False, rebuild=True)
        self.schedule = SCHEDULES[cfg.trainer.mode](ctx, self.collector)  # pipeline: the kept engines' loops start in _train
        self._resume(resync_engines=True)

    def _setup(self) -> None:
        if self.ctx is not None:  # a learner rank died and the engines were kept
            self._restart_learners()
            return
        # Padding positions are masked out; a tokenizer without a pad token pads with EOS (or 0).
        tok = self.tokenizer
        self.pad_id = next((i for i in (tok.pad_token_id, tok.eos_token_id) if i is not None), 0)
        # Ray, every actor ready, placement.json; then the learner group, the engines' pool and weights
        ctx = self.ctx = start_run(self.cfg, self.run_dir, self.inputs, self.stop, self.versions, self._engines_lock)
        self.collector = Collector(ctx)
        self.schedule = SCHEDULES[self.cfg.trainer.mode](ctx, self.collector)
        ctx.weights.update(send=False, rebuild=True)
        self._resume()

    def _resume(self, resync_engines: bool = False) -> None:
        """Where _open_log's resume point says: a checkpoint (cluster/driver/checkpoints.py), or step 0.
        `resync_engines`: the engines were kept across a learner restart and hold newer weights than the
        resume point: they get the resumed ones (verified) even when that is the base model."""
        path, state, weights = self.resume_from.path, self.resume_from.state, self.ctx.weights
        self._unrecorded = None
        if path is None:  # from step 0 (a restart before the first checkpoint: from step 0 again)
            self.step = self.version = self.regenerated_on_resume = 0
            self.stream.load_state({"epoch": 0, "index": 0})
            if resync_engines:  # (the generation is idle: _engines_outlive_learners waited for it)
                weights.update()
            # New engines hold the base weights, kept ones were just sent them. Left at the version the run
            # reached before the restart, every engine's answer would look stale ("restarted: base weights")
            # and be revived and re-sent for ever.
            self.versions.sent = self.version
            return
        back = checkpoints.restore(self.cfg, path, state, self.ctx.learners, self.stream)
        self.step, self.version, self.resumed_batch = back.step, back.version, back.batch
        self.saved_step = back.step
        self.regenerated_on_resume = back.regenerated
        weights.update()
        print(back.said(), flush=True)

    def save_checkpoint(self, finished: bool = False, position=None) -> Path:
        """Checkpoint the step just trained (cluster/driver/checkpoints.py) with what the schedule says of it (async:
        the next step's batch, saved with it); `finished`: the run's last one (a rerun says it is done); `position`:
        a failure's data position (Schedule.failure_position), saved with no pending batch."""
        parts = self.schedule.checkpoint_parts()
        if position is not None:
            parts = CheckpointParts(position)
        path = checkpoints.save(self.cfg, self.ckpt_root, self.step, self.version, parts.position, self.ctx.learners,
                                self.log, pending=parts.pending, before_pending=parts.before_pending, finished=finished)
        self.saved_step = self.step
        return path

    def _save_before_failing(self, error: BaseException) -> None:
        """The run stops on `error` while its learner lives (an engine dead past rollout.max_restarts or hung past
        trainer.actor_timeout_s, the pipeline's wait): the steps trained since the last checkpoint are saved first
        and the line says what to rerun (issue 59: 7-11 steps were lost so). A step the learner trained whose
        weight update failed is logged and saved as trained. The data position is the schedule's
        (Schedule.failure_position: sync, after the recorded step's own batch; async, before the batch being
        collected; pipeline, the feeder's, with its prompts in flight)."""
        if self.ctx is None or self.schedule is None or self.log is None:
            return
        trained_now = self._unrecorded is not None
        if trained_now:
            self._record_step(*self._unrecorded)  # without the pipeline's engine metrics: the step did not finish
        if self.step <= self.saved_step:
            return
        try:
            path = self.failure_checkpoint = self.save_checkpoint(position=self.schedule.failure_position(trained_now))
        except Exception as e:  # noqa: BLE001 - the run's own error is the one raised
            print(f"the run stops on a failure (below); saving a checkpoint of step {self.step} first failed too "
                  f"({type(e).__name__}: {e}): a rerun resumes from the last one saved", flush=True)
            return
        print(f"the run stops on a failure (below) with its learner alive: the checkpoint of step {self.step} was "
              f"saved first ({path}); once the cause is dealt with, run the same command again to resume from it",
              flush=True)

    def _teardown(self) -> None:
        if self.ctx is not None:
            shutdown_actors(self.ctx.actors)
            self.ctx = None
