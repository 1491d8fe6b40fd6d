"""What a run does before its first step, in order: read its inputs, then start Ray and the actors.

`load_inputs` runs before any actor starts, so bad data, an unknown reward name, a reward function that
needs a column the data lacks or an environment that cannot load fails in seconds, not after the engines
loaded a model (minutes on a real one). The prompts are rendered and length-filtered once, here, with the
model's tokenizer.

`start_actors` starts (or joins) the Ray cluster and the actors, and says where each one runs: placement.json,
the console's network line, each role's threads. `start_run` then builds the run's context on them once
(cluster/driver/context.py): the learner group, the engines' pool, the weights' state, what an actor running
again is given; the driver loop (cluster/driver/trainer.py) hands it to the collector and its schedule.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from actors.multiturn.env_pool import EnvPool
from actors.multiturn.trajectories import ChatTokens, TemplateError
from actors.rewards.scorer import RewardScorer
from actors.runtime.start_up import starts_with_few_full_collections
from actors.transport.registry import resolve_backend
from cluster.config import ConfigError, RunConfig
from cluster.data.dataset import DataError, Example, PromptStream, load_run_data, load_tokenizer, reward_column_problem
from cluster.data.model_check import eos_warning
from cluster.driver.actor_restarts import RestartWatch
from cluster.driver.batch import EnvironmentNotes
from cluster.driver.comebacks import Comebacks
from cluster.driver.context import RunContext
from cluster.driver.engine_weights import EngineWeights, WeightVersions
from cluster.driver.placement_record import PlacementRecord, actor_name
from cluster.driver.reference import ReferenceLogprobs
from cluster.driver.worker_groups import LearnerGroup, RolloutPool
from cluster.launch.hosts import HostWatch, divert_node_death_lines
from cluster.launch.placement import (
    Actors,
    apply_thread_budget,
    create_actors,
    resources,
    start_waiting_rollouts,
    wait_ready,
)
from cluster.launch.ray_cluster import embedded_cluster, pin_network_interface, start_ray
from cluster.run import logs
from cluster.run.stopping import StopSignals


def check_multiturn(cfg: RunConfig, tokenizer) -> None:
    """Before any actor starts: the environment class loads (in a throwaway process, as on the engines)
    and the model's chat template (`tokenizer`: the run's, load_tokenizer) can extend a conversation
    token-exactly."""
    try:
        EnvPool(cfg.rollout.env, 1, cfg.rollout.env_timeout_s).close()
        ChatTokens(tokenizer, cfg.data.chat_template_kwargs)
    except (ValueError, TypeError, TemplateError) as e:
        raise ConfigError([str(e)], "rollout.env") from None


@dataclass
class RunInputs:
    tokenizer: object  # the model's (transformers) tokenizer
    heldout: list[Example]  # the held-out prompts (data.eval, or data.num_eval taken from the train data)
    stream: PromptStream  # the training prompts, in the seeded order a resume continues
    scorer: RewardScorer  # the reward functions, loaded and checked against the data
    env_notes: EnvironmentNotes  # what the environments' failures said so far (multi-turn), for the whole run


@starts_with_few_full_collections  # transformers imported, the tokenizer and data loaded (actors/runtime/start_up.py)
def load_inputs(cfg: RunConfig) -> RunInputs:
    """The tokenizer, the data (its notes printed) and the reward scorer, each checked; raises DataError or
    ConfigError naming the problem."""
    tokenizer = load_tokenizer(cfg.model.path)
    data = load_run_data(cfg, tokenizer)
    for note in [*data.notes(), eos_warning(cfg.model.path, cfg.rollout)]:
        if note:
            print(note, flush=True)
    missing = reward_column_problem(cfg, data)  # what the reward functions would fail on at step 1
    if missing:
        raise DataError(missing)
    stream = PromptStream(data.train, cfg.trainer.seed)
    try:  # unknown reward names / missing files fail here, before any actor starts
        scorer = RewardScorer(cfg.reward)
    except ValueError as e:
        raise ConfigError([str(e)], "reward config") from None
    problems = scorer.data_problems(chat=any(isinstance(e.prompt, list) for e in data.train))
    if problems:
        scorer.close()
        raise ConfigError(problems, "reward config")
    if cfg.rollout.env:
        check_multiturn(cfg, tokenizer)
    return RunInputs(tokenizer, data.heldout, stream, scorer, EnvironmentNotes(cfg.rollout.max_model_len))


@dataclass
class StartedActors:
    actors: Actors
    placement: PlacementRecord  # placement.json: every actor's host, pid, threads
    threads: dict[str, int]  # {role: torch threads} (apply_thread_budget)
    lend: dict[int, int]  # {learner rank: threads} while collecting idles (async, CPU)
    learner_params: int | None  # the model's parameter count, as learner rank 0 reports it (perf/mfu)
    hosts: HostWatch  # which actors each host holds (a lost host is said with them)


@starts_with_few_full_collections
def start_actors(cfg: RunConfig, run_dir: Path, scorer: RewardScorer, stop: StopSignals) -> StartedActors:
    """Ray (embedded, or joined at ray.address), then every actor, waited for until ready (each says what it
    waits on while it loads). `scorer` is handed the reward models' handles; `stop` is installed after
    ray.init (which installs its own SIGTERM handler) and stops at once until training starts."""
    logs.start_run_log(run_dir)  # third-party INFO lines of the driver into RUN_DIR/logs/driver.log
    # before start_ray: the workers' env is fixed there (an embedded cluster's interface must exist on this host)
    pin_network_interface(cfg.ray.network_interface, embedded=embedded_cluster(cfg.ray.address))
    start_ray(cfg.ray.address, cfg.ray.num_cpus, logs.worker_env(run_dir))  # the workers' output: RUN_DIR/logs/
    stop.install()
    divert_node_death_lines()  # a lost host is said in raygrpo's words (cluster/launch/hosts.py)
    stop.armed = False  # until training starts a stop signal stops at once: nothing new to save
    actors = create_actors(  # reference.placement: the actor, or the learner ranks themselves
        cfg, with_reference=cfg.algo.beta > 0 and not cfg.reference_on_learner(),
        reward_models=scorer.actor_paths())
    placement = PlacementRecord(wait_ready(actors, cfg.trainer.actor_timeout_s), run_dir, actors,
                                cfg.trainer.actor_timeout_s)
    threads = apply_thread_budget(actors, placement.rows, cfg)
    placement.say_network()  # every actor's host, address and interface: placement.json and the console
    scorer.attach(actors.reward_models, cfg.trainer.actor_timeout_s)  # it calls their handles itself
    lend = {int(p["role"].split("-")[1]): p["threads_when_collecting_idles"]
            for p in placement if "threads_when_collecting_idles" in p}
    learner_params = next((p.get("total_params") for p in placement if p["role"] == "learner-0"), None)
    hosts = HostWatch()
    for p in placement:
        hosts.place(actor_name(p), p.get("node_id"))
    return StartedActors(actors, placement, threads, lend, learner_params, hosts)


def start_run(cfg: RunConfig, run_dir: Path, inputs: RunInputs, stop: StopSignals, versions: WeightVersions,
              engines_lock: threading.RLock) -> RunContext:
    """The actors started (start_actors), then the run's context built on them, once: the learner group, the
    engines' pool, the weights on the engines, what an actor running again is given, the reference's waits.
    `versions`: the loop's weight versions (held across a full restart); `engines_lock`: held around each
    weight update and each generate (vLLM must not serve one between the calls of an update)."""
    up = start_actors(cfg, run_dir, inputs.scorer, stop)  # Ray, every actor ready, placement.json
    actors, r, timeout_s = up.actors, cfg.rollout, cfg.trainer.actor_timeout_s
    learners = LearnerGroup(actors.learners, timeout_s)
    start_waiting_rollouts(actors, cfg)  # an elastic start's engines with no room yet: pending on Ray
    pids = {int(p["role"].split("-")[1]): p["pid"] for p in up.placement if p["role"].startswith("rollout-")}
    # The pool calls back into the comebacks, which hand an engine to the weights, which send through the
    # pool: the handlers reach `comebacks` once it is built below (the pool calls none before an engine fails).
    pool = RolloutPool(actors.rollouts, timeout_s, lambda w, new_process: comebacks.engine_restarted(w, new_process),
                       [pids.get(w) for w in range(r.num_workers)], on_rejoin=lambda w, info: comebacks.engine_up(w, info),
                       hosts=up.hosts, min_live=r.min_live_workers(), node_wait_s=cfg.ray.node_wait_s, live=sorted(pids),
                       bundle=resources(r.num_cpus, r.num_gpus))
    weights = EngineWeights(cfg, versions, resolve_backend(r.weight_transfer_backend, r.num_gpus), pool, learners,
                            up.threads, up.hosts, engines_lock)
    comebacks = Comebacks(actors, up.placement, up.hosts, up.threads, weights, inputs.scorer, pool, timeout_s)
    ref = cfg.reference
    restarts = RestartWatch(up.hosts, cfg.ray.node_wait_s, {"reference actor": resources(ref.num_cpus, ref.num_gpus)},
                            comebacks.actor_back,
                            pids={actor_name(p): p["pid"] for p in up.placement if p["role"] == "reference"})
    return RunContext(cfg, run_dir, inputs.stream, inputs.scorer, inputs.tokenizer.eos_token_id, inputs.env_notes,
                      actors, up.placement, up.hosts, up.threads, up.lend, up.learner_params, learners, pool, versions,
                      weights, comebacks, restarts,
                      ReferenceLogprobs(actors.reference, timeout_s, restarts) if actors.reference is not None else None)
