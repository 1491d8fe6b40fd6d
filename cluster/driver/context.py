"""A run's context: what start-up built once, handed to every part of the driver that needs it.

`cluster/driver/startup.py` (`start_run`) builds it when the actors are up: the fleet (the actors' handles,
the engines' pool), the learner group, the weights' state (their versions and how they reach the engines),
the placement record, the scorer and what the driver gives an actor that runs again. The collector and the
schedules (cluster/driver/schedules/) take it at construction and read what they need; nothing is assigned
into one of these objects from outside afterwards. The objects inside change in their own ways (an engine
revived by the pool, the learner group given new ranks by `LearnerGroup.use`, the versions moved by the
loop's update), so every holder sees the same state.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from actors.rewards.scorer import RewardScorer
    from cluster.config import RunConfig
    from cluster.data.dataset import PromptStream
    from cluster.driver.actor_restarts import RestartWatch
    from cluster.driver.batch import EnvironmentNotes
    from cluster.driver.comebacks import Comebacks
    from cluster.driver.engine_weights import EngineWeights, WeightVersions
    from cluster.driver.placement_record import PlacementRecord
    from cluster.driver.reference import ReferenceLogprobs
    from cluster.driver.worker_groups import LearnerGroup, RolloutPool
    from cluster.launch.hosts import HostWatch
    from cluster.launch.placement import Actors


@dataclass(frozen=True)
class RunContext:
    cfg: RunConfig
    run_dir: Path
    stream: PromptStream  # the training prompts, in the seeded order a resume continues
    scorer: RewardScorer  # the reward functions (and the reward models' handles)
    eos_id: int | None  # the tokenizer's EOS, which ends a multi-turn turn
    env_notes: EnvironmentNotes  # what the environments' failures said so far (multi-turn)
    actors: Actors  # every actor's handle (cluster/launch/placement.py)
    placement: PlacementRecord  # placement.json: every actor's host, pid, threads
    hosts: HostWatch  # which actors each host holds (a lost host is said with them)
    threads: dict[str, int]  # {role: torch threads} (apply_thread_budget)
    lend: dict[int, int]  # {learner rank: threads} while collecting idles (async, CPU)
    learner_params: int | None  # the model's parameter count, as learner rank 0 reports it (perf/mfu)
    learners: LearnerGroup  # the DeepSpeed ranks; LearnerGroup.use gives it new ones after a restart
    pool: RolloutPool  # the engines' elastic fleet
    versions: WeightVersions  # the learner's weight version and the one every engine holds
    weights: EngineWeights  # every connect and weight update of the engines (holds the engines' lock)
    comebacks: Comebacks  # what an actor running again in a new process is given
    restarts: RestartWatch  # waits on the reference actor, saying a lost host and its restart
    reference: ReferenceLogprobs | None  # its log-probs of a batch (None: no reference actor, or on the learner ranks)
