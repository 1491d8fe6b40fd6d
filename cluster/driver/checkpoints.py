"""A run's checkpoint as the driver writes and reads it: everything a resume needs to go on exactly.

A checkpoint (learner/checkpoint.py: written into a temporary directory, committed by a rename once
its manifest is written) holds:
- the learner ranks' DeepSpeed state (weights, optimizer, LR schedule);
- the driver's state: the step, the weight version, the data position, the RNG, the config, and
  whether the run finished there (a rerun then says it is done: cluster/run/resume.py);
- the metrics rows of the steps it covers (MetricsLogger restores rows metrics.jsonl lost from them);
- async: the next step's batch, generated with the weights one version older than the ones saved. A
  resume trains on that very batch, as a run that never stopped does, instead of generating it anew
  with newer weights;
- pipeline: the prompts of the groups in flight (not their partial generations, whose weights are
  gone): a resume generates them again first.
"""
from __future__ import annotations

import shutil
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from cluster.config import RunConfig
from cluster.data.dataset import PromptStream
from cluster.driver.batch import Batch, batch_advantages, load_batch, save_batch
from cluster.run.metrics import MetricsLogger
from learner import checkpoint


@dataclass
class Restored:
    """What a checkpoint gave back to the driver (the learners and the data stream are restored in place)."""

    path: Path
    step: int
    version: int
    batch: Batch | None  # the next step's batch, saved with an async checkpoint (None: collected anew)
    regenerated: int  # pipeline: the groups in flight at the checkpoint, generated again first

    def said(self) -> str:
        carried = " and the next step's batch saved with it" if self.batch is not None else ""
        again = (f"; the {self.regenerated} group(s) in flight at that checkpoint are generated again first "
                 "(pipeline mode records their prompts, not their partial generations, whose weights are gone)"
                 if self.regenerated else "")
        return f"resumed from {self.path} at step {self.step}{carried}{again}"


def save(cfg: RunConfig, root: Path, step: int, version: int, position: Callable[[], dict], learners,
         log: MetricsLogger, *, pending: Future | None = None, before_pending: dict | None = None,
         finished: bool = False) -> Path:
    """Checkpoint `step` under `root`. `position()`: the data position (pipeline: with the prompts in flight),
    read once `pending` (async's next batch, being collected) is complete, so it is past that batch's prompts
    (dynamic sampling's extra ones too); if that batch failed, the checkpoint is saved without it, at its
    data position before it (`before_pending`). `learners`: the LearnerGroup. A half-written checkpoint (a
    full disk) is removed, and the error raised."""
    tmp = checkpoint.begin(root, step)
    try:
        batch_failed = False
        if pending is not None:
            try:
                save_batch(pending.result(), tmp)
            except Exception as e:  # noqa: BLE001 (the training loop raises it again if the run goes on)
                batch_failed = True
                print(f"the next step's batch failed ({type(e).__name__}: {e}); the checkpoint of step "
                      f"{step} is saved without it", flush=True)
        data_state = before_pending if batch_failed else position()  # failed: a resume collects that batch anew
        in_flight = len(data_state.get("in_flight", []))
        if in_flight:
            log.note(f"pipeline: the checkpoint of step {step} records the prompts of the {in_flight} "
                     "group(s) in flight (not their partial generations): a resume generates them again first")
        learners.save(str(tmp), checkpoint.LEARNER_TAG)
        with checkpoint.naming_save_errors(tmp):
            log.save_rows(tmp, step)
        driver_state = {"step": step, "weight_version": version, "data": data_state, "rng": checkpoint.rng_state(),
                        "config": cfg.to_dict(), "finished": finished}
        return checkpoint.commit(tmp, root, step, driver_state, keep=cfg.checkpoint.keep)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # give a half-written checkpoint's space back
        raise


def restore(cfg: RunConfig, path: Path, state: dict, learners, stream: PromptStream) -> Restored:
    """Load checkpoint `path` (its driver state `state`) into the learner ranks, the data stream and the
    driver's RNG; the async batch saved with it comes back when it fits this run's group size and ranks."""
    learners.load(str(path), checkpoint.LEARNER_TAG)
    stream.load_state(state["data"])
    checkpoint.set_rng_state(state["rng"])
    batch = load_batch(path)
    G, ranks = cfg.trainer.group_size, cfg.learner.num_ranks
    if batch is not None and (len(batch.completion_ids) != G * len(batch.examples) or len(batch.completion_ids) % ranks):
        print(f"the batch saved with {path} does not fit trainer.group_size={G} / learner.num_ranks={ranks}: "
              "it is collected anew", flush=True)
        stream.load_state(batch.stream_state)
        batch = None
    elif batch is not None and batch.advantages is None:  # saved before batches carried them
        batch.advantages = batch_advantages(batch.rewards, G, cfg.algo.advantage_estimator)
    return Restored(path, state["step"], state["weight_version"], batch, len(state["data"].get("in_flight", [])))
