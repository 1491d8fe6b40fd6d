"""The run's typed config: YAML file + dotted CLI overrides, validated once before any actor starts.

Every default lives in the dataclasses: the generation side's in `actors/config.py`, the
training side's in `learner/config.py`, the run's own below. `load_config` collects every
problem (unknown key, wrong type, impossible combination) and raises one `ConfigError`
that lists them all, so a user fixes a config in one round.

    raygrpo train run.yaml trainer.steps=50 rollout.temperature=0.7
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar

import pydantic
import yaml

from actors.config import RewardConfig, RolloutConfig
from actors.multiturn.envs import env_spec_problems
from actors.runtime.checks import at_least
from cluster.config_names import unknown_key_problems
from cluster.data.files import path_problem, split_paths
from cluster.data.model_check import model_problems, weight_problems
from cluster.launch.gpu_layout import gpu_layout_problems
from cluster.paths import absolute_paths
from learner.config import AlgoConfig, CheckpointConfig, LearnerConfig, ReferenceConfig


class ConfigError(ValueError):
    def __init__(self, problems: list[str], source: str = "config"):
        self.problems = problems
        super().__init__(f"{source} has {len(problems)} problem(s):\n" + "\n".join(f"  - {p}" for p in problems))


@dataclass
class ModelConfig:
    path: str = ""  # a HF model directory (config.json + weights + tokenizer)

    def problems(self) -> list[str]:
        if not self.path:
            return ["model.path is empty: point it at a HF model directory (`raygrpo demo` builds a small one)"]
        if not (Path(self.path) / "config.json").exists():
            return [f"model.path {self.path!r} is not a model directory (no config.json there)"]
        return weight_problems(Path(self.path))


@dataclass
class DataConfig:
    # task:<name> (built-in arithmetic), or a .jsonl / .json / .parquet file, a comma-separated list of
    # them (concatenated), or a directory written by Dataset.save_to_disk (its "train" split)
    train: str = "task:addition"
    eval: str = ""  # held-out set, same forms ("test"/"validation" split of a DatasetDict); empty: a task's split, or none
    num_eval: int = 64  # held-out prompts evaluated (task splits are generated from the seed)
    task_digits: int = 2  # operand digits of the built-in arithmetic tasks
    prompt_key: str = "prompt"  # the prompt column: a string, or a list of {"role", "content"} messages
    apply_chat_template: bool = False  # also render *string* prompts with the chat template (as one user message)
    system_prompt: str = ""  # added as the first message of conversations that have no system message
    chat_template_kwargs: dict = field(default_factory=dict)  # passed to apply_chat_template, e.g. {enable_thinking: false}
    max_prompt_tokens: int = 0  # rendered prompt length limit; 0: rollout.max_model_len - rollout.max_new_tokens
    long_prompts: str = "filter"  # prompts over the limit: filter (counted, reported once at load) | error

    def problems(self) -> list[str]:
        p = []
        at_least(p, "data.num_eval", self.num_eval, 0)
        at_least(p, "data.task_digits", self.task_digits, 1)
        if not self.train.startswith("task:"):
            parts = split_paths(self.train)
            p += [x for x in (path_problem(f, "data.train") for f in parts) if x] if parts else ["data.train is empty"]
        p += [x for x in (path_problem(f, "data.eval") for f in split_paths(self.eval)) if x]
        if not self.prompt_key:
            p.append("data.prompt_key is empty: name the prompt column")
        at_least(p, "data.max_prompt_tokens", self.max_prompt_tokens, 0, " (0: derived from rollout)")
        if self.long_prompts not in ("filter", "error"):
            p.append(f"data.long_prompts must be filter|error, got {self.long_prompts!r}")
        return p


@dataclass
class TrainerConfig:
    steps: int = 20
    prompts_per_step: int = 8
    group_size: int = 8  # G completions per prompt
    # sync | async (generation of step k+1 overlaps training of step k) | pipeline (the engines never stop;
    # weight updates land mid-request; each token carries its version: cluster/driver/pipeline.py)
    mode: str = "sync"
    # async: a batch generated more than this many versions ago is dropped; pipeline: a group whose oldest
    # token is more than this many versions behind is dropped and its prompt generated again (stale_groups)
    max_staleness: int = 1
    # pipeline: groups in flight over all engines (submitted, or back and not yet trained on): how far the
    # engines may run ahead of the learner; 0: max_staleness x prompts_per_step (more would be generated only
    # to be dropped as stale once the engines keep up: cluster/driver/pipeline.py), at most
    # PIPELINE_STEPS_AHEAD x prompts_per_step whatever max_staleness is (issue 59: a bound of 10^9 versions
    # took 10^9 prompts from the stream and the driver's memory grew 25 MB/s)
    pipeline_groups_in_flight: int = 0
    seed: int = 0
    run_dir: str = "runs/raygrpo"
    eval_every: int = 0  # steps between held-out evaluations (0: only before and after training)
    # pass@k on the held-out set: k sampled completions per held-out prompt, on top of the greedy one that
    # accuracy reads, so an evaluation costs (1 + k) x data.num_eval completions. 0: greedy accuracy alone,
    # the cheapest evaluation (README, "Evaluation"); the examples set their own k.
    eval_pass_k: int = 0
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, refill from more prompts
    max_extra_prompts: int = 16  # cap on extra prompts generated per step to refill dropped groups
    actor_timeout_s: float = 600.0  # any single wait on an actor; past it: an error naming the actor
    max_learner_restarts: int = 1  # a dead learner rank: resume from the last checkpoint this many times
    # SIGTERM / SIGINT: finish the step, save a checkpoint and exit, if that takes at most this long;
    # past it (or on a second signal) stop at once, keeping the last complete checkpoint.
    stop_grace_s: float = 25.0  # SLURM and Kubernetes wait 30 s before SIGKILL by default
    # Training health, checked after every step. A condition that holds for `halt_after`
    # consecutive steps halts the run (checkpoint first, then a diagnosis). 0 turns a guard off.
    halt_after: int = 10  # 0: never halt (the conditions are still warned about)
    halt_on_zero_variance: bool = True  # every group's rewards are all equal: no learning signal
    entropy_floor: float = 1e-3  # mean token entropy (nats) below this: the policy collapsed
    kl_ceiling: float = 5.0  # KL to the reference (per token, median of the last 5 steps: health.py) above this: ran away
    logprob_diff_warn: float = 0.05  # mean |learner - vLLM| log-prob of the sampled tokens (fresh batches): warn above
    logprob_diff_ceiling: float = 1.0  # ... and count as unhealthy above this

    # What a default in-flight bound resolves to at most (steps of prompts ahead), what an explicit one may be
    # at most, and the largest max_staleness taken: past these numbers a bound is no bound (the engines never
    # run that far ahead), and such a value is a typo or a way to say "never drop", which trainer.steps says.
    PIPELINE_STEPS_AHEAD: ClassVar[int] = 8
    PIPELINE_MAX_STEPS_AHEAD: ClassVar[int] = 64
    MAX_STALENESS: ClassVar[int] = 1000

    def problems(self) -> list[str]:
        p = []
        if not self.run_dir.strip():
            p.append("trainer.run_dir is empty: name a directory for this run (e.g. runs/my-run)")
        at_least(p, "trainer.eval_pass_k", self.eval_pass_k, 0, " (0: greedy accuracy only)")
        at_least(p, "trainer.eval_every", self.eval_every, 0)
        at_least(p, "trainer.max_extra_prompts", self.max_extra_prompts, 0)
        at_least(p, "trainer.max_learner_restarts", self.max_learner_restarts, 0)
        at_least(p, "trainer.stop_grace_s", self.stop_grace_s, 0)
        at_least(p, "trainer.halt_after", self.halt_after, 0, " (0: never halt)")
        for name in ("entropy_floor", "kl_ceiling", "logprob_diff_warn", "logprob_diff_ceiling"):
            if getattr(self, name) < 0:
                p.append(f"trainer.{name} must be >= 0 (0: off), got {getattr(self, name)}")
        at_least(p, "trainer.steps", self.steps, 1)
        if not 0 <= self.seed < 2**32:  # numpy's and vLLM's seeds are unsigned 32-bit
            p.append(f"trainer.seed must be a whole number from 0 to 2**32-1, got {self.seed}")
        at_least(p, "trainer.prompts_per_step", self.prompts_per_step, 1)
        at_least(p, "trainer.group_size", self.group_size, 2, " (group advantages need a group)")
        if self.mode not in ("sync", "async", "pipeline"):
            p.append(f"trainer.mode must be sync|async|pipeline, got {self.mode!r}")
        at_least(p, "trainer.pipeline_groups_in_flight", self.pipeline_groups_in_flight, 0, " (0: max_staleness x prompts_per_step)")
        at_least(p, "trainer.max_staleness", self.max_staleness, 0)
        if self.max_staleness > self.MAX_STALENESS:
            p.append(f"trainer.max_staleness={self.max_staleness} is above {self.MAX_STALENESS}: a bound that large is none "
                     "(the engines never run that far ahead); to train on every group whatever its age, set "
                     f"trainer.max_staleness to trainer.steps ({self.steps}) or to at most {self.MAX_STALENESS}")
        if self.pipeline_groups_in_flight and self.mode != "pipeline":  # issue 59: ignored without a word
            p.append(f"trainer.pipeline_groups_in_flight={self.pipeline_groups_in_flight} is read only by "
                     f"trainer.mode=pipeline, and trainer.mode is {self.mode}: remove it, or set trainer.mode=pipeline")
        most = self.PIPELINE_MAX_STEPS_AHEAD * self.prompts_per_step
        if self.pipeline_groups_in_flight > most:
            p.append(f"trainer.pipeline_groups_in_flight={self.pipeline_groups_in_flight} is above "
                     f"{self.PIPELINE_MAX_STEPS_AHEAD} x trainer.prompts_per_step = {most}: the engines would run that many "
                     "steps ahead and their groups go stale; lower it (0: max_staleness x prompts_per_step)")
        if self.actor_timeout_s <= 0:
            p.append(f"trainer.actor_timeout_s must be > 0, got {self.actor_timeout_s}")
        return p


@dataclass
class RayConfig:
    address: str = ""  # "": an embedded local cluster; "auto" or "HOST:PORT": join that cluster
    num_cpus: int = 0  # embedded cluster's logical CPUs (0: the machine's, at least 8 so fractional actors fit)
    placement: str = "separate"  # separate | colocate (learner rank i and rollout engine i share a bundle)
    strategy: str = "PACK"  # how the placement group's bundles land on nodes: PACK | SPREAD | STRICT_SPREAD
    # The network interface gloo and NCCL use on every node, e.g. "eth0": sets GLOO_SOCKET_IFNAME and
    # NCCL_SOCKET_IFNAME for every actor. "": the driver's GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME reach the
    # actors as they are; where neither is set, each actor uses the interface on its route to learner rank 0.
    network_interface: str = ""
    # How long a learner rank waits for learner rank 0's host to answer at the address it advertises;
    # past it, an error naming both hosts and the address (an engine: the weight transfer's own timeout).
    connect_timeout_s: float = 60.0
    # After a host was lost: how long the run waits for a node with room, when what is left holds fewer
    # engines than rollout.min_workers or no room for a learner rank's bundle; past it, an error says what
    # was missing. Each wait says what it waits for.
    node_wait_s: float = 300.0

    def problems(self) -> list[str]:
        p = []
        at_least(p, "ray.num_cpus", self.num_cpus, 0, " (0: the machine's)")
        if self.connect_timeout_s <= 0:
            p.append(f"ray.connect_timeout_s must be > 0, got {self.connect_timeout_s}")
        if self.network_interface and not re.fullmatch(r"[A-Za-z0-9_.:-]{1,15}", self.network_interface):
            # Linux's names: at most 15 characters (IFNAMSIZ 16 with the NUL); gloo and NCCL get it in their env
            p.append(f"ray.network_interface must be one network interface's name (letters, digits and _ . : -, at "
                     f"most 15 characters, such as eth0 or eth0:1), got {self.network_interface!r}")
        if self.node_wait_s <= 0:
            p.append(f"ray.node_wait_s must be > 0, got {self.node_wait_s}")
        if self.placement not in ("separate", "colocate"):
            p.append(f"ray.placement must be separate|colocate, got {self.placement!r}")
        if self.strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            p.append(f"ray.strategy must be PACK|SPREAD|STRICT_PACK|STRICT_SPREAD, got {self.strategy!r}")
        return p


@dataclass
class MetricsConfig:
    tensorboard: bool = True
    wandb: bool = False  # used only when the wandb package is installed
    wandb_project: str = "raygrpo"
    wandb_run_name: str = ""  # "": W&B picks one
    wandb_entity: str = ""  # the W&B team or user; "": your default entity
    wandb_tags: list[str] = field(default_factory=list)
    # A few completions per step, with each reward function's score and the advantage, in
    # completions.jsonl (+ TensorBoard text, a W&B table); `raygrpo show RUN_DIR` prints them.
    log_completions: bool = True
    completions_per_step: int = 4
    # The learner device's peak TFLOP/s (bf16 dense; e.g. 989 for an H100 SXM), as `raygrpo bench
    # --peak-tflops`: the steps then log perf/mfu. 0: unknown, no perf/mfu.
    peak_tflops: float = 0.0

    def problems(self) -> list[str]:
        p = []
        at_least(p, "metrics.completions_per_step", self.completions_per_step, 1)
        at_least(p, "metrics.peak_tflops", self.peak_tflops, 0, " (0: unknown, no perf/mfu)")
        return p

    def wandb_init(self) -> dict | None:
        """wandb.init's keywords for this run, or None when W&B is off."""
        if not self.wandb:
            return None
        return {"project": self.wandb_project, "name": self.wandb_run_name or None, "entity": self.wandb_entity or None,
                "tags": list(self.wandb_tags) or None}


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def problems(self) -> list[str]:
        p = []
        for f in dataclasses.fields(self):
            p += getattr(self, f.name).problems()
        t, lrn, r = self.trainer, self.learner, self.rollout
        n_seq = t.prompts_per_step * t.group_size
        if lrn.num_ranks >= 1 and n_seq % lrn.num_ranks:  # (< 1 is learner.num_ranks' own problem)
            p.append(
                f"trainer.prompts_per_step * trainer.group_size = {n_seq} completions per step is not divisible "
                f"by learner.num_ranks = {lrn.num_ranks}"
            )
        if t.prompts_per_step < r.num_workers:
            p.append(f"trainer.prompts_per_step ({t.prompts_per_step}) < rollout.num_workers ({r.num_workers}): some engines would idle")
        if r.tensor_parallel_size > 1 and r.num_gpus == 0:
            p.append("rollout.tensor_parallel_size > 1 needs GPUs (set rollout.num_gpus); on CPU use 1")
        p += gpu_layout_problems(self)  # layouts NCCL, vLLM or Ray refuse at start (cluster/launch/gpu_layout.py)
        if self.algo.ratio_level == "sequence" and self.algo.clip_high > 0.01:
            p.append(
                f"algo.ratio_level=sequence (GSPO) with clip_high={self.algo.clip_high}: GSPO's sequence ratios need "
                "clip ranges around 3e-4..4e-4; set algo.clip_low/clip_high"
            )
        if t.mode in ("async", "pipeline") and t.max_staleness < 1:
            p.append(f"trainer.mode={t.mode} generates one weight version behind or more: set trainer.max_staleness >= 1")
        if t.mode == "pipeline":
            p += self._pipeline_problems()
        room = r.max_model_len - r.max_new_tokens
        if self.data.max_prompt_tokens > room:
            p.append(f"data.max_prompt_tokens ({self.data.max_prompt_tokens}) > rollout.max_model_len - rollout.max_new_tokens "
                     f"({room}): the engine has no room for such prompts; lower it or raise rollout.max_model_len")
        p += env_spec_problems(r.env)
        if not self.reward.functions and not r.env:
            p.append("reward.functions is empty: name at least one reward function (it may be empty only with "
                     "rollout.env, whose environment gives the rewards)")
        if r.max_turns > 1 and not r.env:
            p.append(f"rollout.max_turns={r.max_turns} needs rollout.env (an environment that answers each turn)")
        if t.dynamic_sampling and t.max_extra_prompts < 1:
            p.append("trainer.dynamic_sampling needs trainer.max_extra_prompts >= 1")
        return p

    def _pipeline_problems(self) -> list[str]:
        """What trainer.mode=pipeline does not support (yet), each with what to do instead."""
        t, r, p = self.trainer, self.rollout, []
        for bad, what in ((bool(r.env), "multi-turn rollouts (rollout.env)"), (bool(r.stop), "rollout.stop strings"),
                          (self.learner.lora and self.learner.lora_sync == "adapter", "LoRA adapter sync "
                           "(learner.lora_sync=adapter; use merged)"),
                          (t.eval_every > 0, "evaluations during training (trainer.eval_every; the evaluations "
                           "before and after training run)")):
            if bad:
                p.append(f"trainer.mode=pipeline does not support {what}: use trainer.mode=async for it")
        return p

    def reference_on_learner(self) -> bool:
        """Whether the learner ranks compute the reference log-probs (and no reference actor starts):
        reference.placement, where "auto" means the learner with LoRA (the base model is already
        there) and in the sync schedule on CPU (each rank runs the frozen copy on its own shard with
        the whole node's cores, and the step loses a process hop), else the actor: on GPU (a large
        model's copy on its own device) and in the async schedule, where the actor's pass is part of
        collecting and so overlaps training (docs/benchmarks.md has the measurements)."""
        lrn = self.learner
        if self.algo.beta <= 0 or (lrn.lora and lrn.lora_reference_actor):
            return False
        if self.reference.placement != "auto":
            return self.reference.placement == "learner"
        return lrn.lora or (lrn.num_gpus == 0 and self.trainer.mode == "sync")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- loading


def _dotted_keys(cls, prefix: str = "") -> list[str]:
    """Every config key as `section.key` (what "did you mean" chooses from)."""
    out = []
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        out += _dotted_keys(tp, f"{prefix}{f.name}.") if dataclasses.is_dataclass(tp) else [prefix + f.name]
    return out


def _yaml11_number(value: Any) -> Any:  # YAML 1.1 reads `3e-4` (no dot) as a string: a float knob takes its number
    with contextlib.suppress(ValueError):
        return float(value) if isinstance(value, str) else value
    return value


@functools.cache
def _input_model(cls) -> type[pydantic.BaseModel]:
    """A strict pydantic model of what a config may hold for the dataclass `cls`: a bool is no int, 8.5 no
    int, 1 no bool (an int is a float); NaN and inf are refused (every comparison with NaN is False, so the
    range checks would wave it through); an unknown key is an error. pydantic's strict mode takes only an
    instance for a stdlib dataclass, not a mapping, so this mirrors `cls` field by field; every field is
    None and left out when unset: the defaults stay in the dataclass."""
    def of(tp):
        if dataclasses.is_dataclass(tp):
            return _input_model(tp)
        if tp is float:
            return Annotated[float, pydantic.BeforeValidator(_yaml11_number)]
        args, origin = typing.get_args(tp), typing.get_origin(tp)
        return (typing.Union if origin is types.UnionType else origin)[tuple(map(of, args))] if args else tp

    hints, strict = typing.get_type_hints(cls), pydantic.ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    return pydantic.create_model(cls.__name__, __config__=strict, **{f.name: (of(hints[f.name]), None)
                                                                     for f in dataclasses.fields(cls)})


@functools.cache
def _dataclasses() -> pydantic.TypeAdapter:  # builds the RunConfig of a mapping _input_problems passed
    return pydantic.TypeAdapter(RunConfig)


def _text_keys(data: Any) -> Any:  # YAML's `1:`, `null:` or `yes:` keys: unknown keys like any other
    return {str(k): _text_keys(v) for k, v in data.items()} if isinstance(data, dict) else data


def _input_problems(data: Any) -> tuple[dict, list[str]]:
    """Every type problem and unknown key in `data` at once, one line each; `data` without them (a mistyped
    value's setting keeps its default, so the range checks still run on the rest)."""
    data = _text_keys(data)
    try:
        _input_model(RunConfig).model_validate(data)
        return data, []
    except pydantic.ValidationError as e:
        errors = e.errors()
    if not isinstance(data, dict):
        return {}, [f"config: expected a mapping, got {data!r}"]
    problems, wrong, left_out, known = [], {}, [], _dotted_keys(RunConfig)
    for err in errors:
        keys, node = (), data  # the keys of `data` the error is under (a list's index or a union's member ends them)
        while isinstance(node, dict) and len(keys) < len(err["loc"]) and err["loc"][len(keys)] in node:
            keys, node = (*keys, err["loc"][len(keys)]), node[err["loc"][len(keys)]]
        left_out.append(keys)
        *section, key = keys
        if err["type"] == "extra_forbidden":
            prefix = "".join(f"{k}." for k in section)
            names = sorted({k[len(prefix):].split(".")[0] for k in known if k.startswith(prefix)})
            problems += unknown_key_problems(key, node, ".".join(section), names, known)
        else:  # a union (learner.zero_stage: int | str) errs once per member: one line
            where = ".".join(keys) + "".join(f"[{i}]" for i in err["loc"][len(keys):] if isinstance(i, int))
            want = "a mapping" if err["type"] == "model_type" else err["msg"].removeprefix("Input should be ")
            wrong.setdefault(where, (err["input"], []))[1].append(want)
    problems += [f"{where}: expected {' or '.join(dict.fromkeys(wants))}, got {type(value).__name__} {value!r}"
                 for where, (value, wants) in wrong.items()]
    for *section, key in left_out:
        functools.reduce(lambda node, k: node.get(k, {}), section, data).pop(key, None)
    return data, problems


def apply_overrides(data: dict, overrides: list[str], problems: list[str]) -> dict:
    """`a.b=c` sets data["a"]["b"] = yaml(c): `trainer.steps=50`, `rollout.stop=["\\n"]`. A value that
    YAML would cut at a comment (" #" outside quotes: `data.system_prompt=End with #### and the number.`)
    is taken whole, as a string: the shell already removed the comments a command line may hold."""
    for item in overrides:
        if "=" not in item:
            problems.append(f"override {item!r} is not KEY=VALUE (e.g. trainer.steps=50)")
            continue
        key, raw = item.split("=", 1)
        try:
            value = raw if _yaml_cuts_a_comment(raw) else yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            problems.append(f"override {item!r}: value is not valid YAML ({e})")
            continue
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                problems.append(f"override {item!r}: {part} is not a section")
                break
        else:
            node[parts[-1]] = value
    return data


def _yaml_cuts_a_comment(raw: str) -> bool:
    """Whether YAML reads the end of `raw` as a comment (and drops it): a " #" outside quotes."""
    try:
        tokens = [t for t in yaml.scan(raw) if not isinstance(t, (yaml.StreamStartToken, yaml.StreamEndToken))]
    except yaml.YAMLError:
        return False
    end = max((t.end_mark.index for t in tokens), default=0)
    return raw[end:].lstrip().startswith("#")


def load_config(path: str | Path | None = None, overrides: list[str] = (), validate_paths: bool = True) -> RunConfig:
    """Read YAML + overrides into a RunConfig; raise one ConfigError listing every problem."""
    problems: list[str] = []
    data: dict = {}
    source = str(path) if path else "config"
    if path:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError([f"config file {path} does not exist"], source) from None
        except yaml.YAMLError as e:
            raise ConfigError([f"not valid YAML: {e}"], source) from None
    data, wrong = _input_problems(apply_overrides(data, list(overrides), problems))
    problems += wrong  # a mistyped value is left out: its setting keeps the default, and the range checks run
    cfg = _dataclasses().validate_python(data)  # checked above: this only builds the dataclasses
    if validate_paths:  # (submit keeps them as written: they are read on the cluster, from the job's directory)
        cfg = _dataclasses().validate_python(absolute_paths(cfg.to_dict()))
    own = cfg.problems()
    problems += [p for p in own if validate_paths or not _is_path_problem(p)]  # ranges, together
    if validate_paths and not any(p.startswith("model.path") for p in own):
        problems += model_problems(cfg)  # the config against the model's files: positions, LoRA targets
    if problems:
        raise ConfigError(problems, source)
    return cfg


def _is_path_problem(problem: str) -> bool:
    return problem.startswith(("model.path", "data.train", "data.eval", "checkpoint.resume", "rollout.env file not found"))


def save_config(cfg: RunConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
