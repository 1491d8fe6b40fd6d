"""The reward-model kind of `reward.functions` entry: `model:PATH`, a HF AutoModelForSequenceClassification
directory with one label, scored by a RewardModelActor (model_actor.py) the driver starts for the entry
(`actor_path`) and attaches to the scorer: the scorer calls the actor's handle itself.

Ray restarts a dead actor and runs the lost call again (its max_task_retries); each wait is bounded
by trainer.actor_timeout_s, and a restart is said on the console when the answer comes from a new
process. The entry's metric name is the directory's basename.

Deliberately light (json, os; Ray only where a call is waited for): the driver checks a config before
anything heavy starts.
"""
from __future__ import annotations

import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor

from actors.config import RewardConfig
from actors.rewards.base import Batch, KindRunner, RewardKind, Tally, safe_name
from actors.runtime.waits import ActorFailed, actor_table_entry, wait_for

PREFIX = "model:"
HOST_VERDICT_WAIT_S = 60.0  # how long a broken connection waits for Ray to say the actor left its host


def wait_moved(handle, wait_s: float) -> None:
    """Until Ray's actor table shows the actor no longer ALIVE where it was (its host marked dead: restarting,
    or alive on another node), at most `wait_s`: then a call sent to it waits for the restarted actor."""
    def where() -> tuple[str, str]:
        info = actor_table_entry(handle)
        return str(info.get("State", "")), str((info.get("Address") or {}).get("NodeID", ""))

    first, deadline = where(), time.monotonic() + wait_s
    while time.monotonic() < deadline:
        state_now, node_now = where()
        if (state_now and state_now != "ALIVE") or (state_now == "ALIVE" and node_now != first[1]):
            return
        time.sleep(1.0)


def model_path(spec: str) -> str:
    return spec[len(PREFIX):]


class ModelKind(RewardKind):
    name = "model"
    form = "a reward model as 'model:PATH'"
    stats = ("truncated",)

    def recognises(self, spec: str) -> bool:
        return spec.startswith(PREFIX)

    def resolve(self, spec: str) -> str:
        return PREFIX + os.path.abspath(model_path(spec))

    def default_name(self, spec: str, loaded: dict[str, str]) -> str:
        return safe_name(os.path.basename(os.path.normpath(model_path(spec))))

    def problems(self, spec: str) -> list[str]:
        return model_dir_problems(model_path(spec))

    def data_problems(self, spec: str, chat: bool) -> list[str]:
        path = model_path(spec)
        if chat and not has_chat_template(path):
            return [f"the reward model {path} has no chat template, but the data's prompts are chat messages: "
                    "give its tokenizer a chat template (tokenizer_config.json or chat_template.jinja)"]
        return []

    def actor_path(self, spec: str) -> str:
        return model_path(spec)

    def start(self, specs: list[str], cfg: RewardConfig) -> RewardModels:
        return RewardModels(specs)


class RewardModels(KindRunner):
    """The reward-model actors' handles, attached by the driver; each call is sent to its actor and
    waited for (bounded) on a thread of its own, so the other kinds score meanwhile."""

    def __init__(self, specs: list[str]):
        self.handles: dict = {}
        self.timeout_s = 0.0
        self.pids: dict[str, int] = {}
        self.restarts = 0
        self._restarted: list[str] = []  # appended on the scoring threads, taken by the driver (restarted_actors)
        self._executor = ThreadPoolExecutor(max(1, len(specs)), thread_name_prefix="reward-model")

    def attach(self, spec: str, handle, timeout_s: float) -> None:
        self.handles[spec], self.timeout_s = handle, timeout_s
        self.pids.pop(spec, None)  # a new actor (the driver restarted every actor): its first pid is no restart

    def send(self, specs: list[str], batch: Batch, tally: Tally, progress):
        messages = [f.get("_messages") for f in batch.fields]
        futures = {}
        for spec in specs:
            if spec not in self.handles:
                raise RuntimeError(f"the reward model {spec} has no actor attached (the driver starts one per model: entry)")
            progress.add(spec)
            handle = self.handles[spec]

            def call(handle=handle):
                return handle.score.remote(batch.prompts, batch.texts, messages if any(messages) else None)
            futures[spec] = self._executor.submit(self._wait, spec, handle, call, len(batch))
            futures[spec].add_done_callback(lambda f, spec=spec: progress.finish(spec))

        def wait() -> None:
            for spec, future in futures.items():
                out = future.result()
                tally.stats[spec].calls, tally.stats[spec].truncated = 1, out["truncated"]
                for i, v in enumerate(out["values"]):
                    finite = math.isfinite(v)
                    tally.record(spec, i, finite, v if finite else f"the reward model's score is {v}")

        return wait

    def _wait(self, spec: str, handle, call, n: int) -> dict:
        """{"values", "truncated", "seconds", "pid"} of `call()`; ActorFailed when the actor is gone or silent
        too long. A broken connection (its host may be going) is waited out once: Ray's own retries of the
        call may run out, each refused at once, before Ray has marked the host dead and restarted the actor
        elsewhere; the call goes again once Ray has said so (at most HOST_VERDICT_WAIT_S), bounded as before."""
        from ray.exceptions import ActorUnavailableError

        path = model_path(spec)
        who, what = f"reward model {path}", f"scoring {n} completions"
        try:
            out = wait_for(call(), who, what, self.timeout_s)
        except ActorFailed as e:
            if not isinstance(e.__cause__, ActorUnavailableError):
                raise
            print(f"{who}: its connection broke while {what}; the call goes again once Ray has restarted it "
                  f"(Ray's verdict waited for at most {HOST_VERDICT_WAIT_S:.0f}s)", flush=True)
            wait_moved(handle, HOST_VERDICT_WAIT_S)
            out = wait_for(call(), who, what, self.timeout_s)
        if self.pids.get(spec, out["pid"]) != out["pid"]:
            self.restarts += 1
            print(f"reward model {path} was restarted (process {self.pids[spec]} -> {out['pid']}); "
                  "Ray ran the lost call again, nothing was skipped", flush=True)
            self._restarted.append(spec)
        self.pids[spec] = out["pid"]
        return out

    def restarted_actors(self) -> list[str]:
        taken, self._restarted = self._restarted, []
        return taken

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def model_dir_problems(path: str) -> list[str]:
    """A reward model directory: a HF sequence-classification model with one label, and a tokenizer."""
    where = f"reward model {path!r} (reward.functions entry model:{path})"
    if not os.path.isdir(path):
        return [f"{where}: no such directory (cwd {os.getcwd()})"]
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        return [f"{where}: cannot read config.json ({e}); expected a directory written by save_pretrained"]
    problems = []
    archs = config.get("architectures") or []
    classifier = not archs or any(a.endswith("ForSequenceClassification") for a in archs)
    if not classifier:
        problems.append(f"{where} is a {', '.join(archs)}, not a ...ForSequenceClassification model "
                        "(AutoModelForSequenceClassification with num_labels=1)")
    # Labels mean something only for a classifier: a causal LM's config carries transformers' default of 2
    labels = len(config["id2label"]) if isinstance(config.get("id2label"), dict) else config.get("num_labels", 2)
    if classifier and labels != 1:
        problems.append(f"{where} has {labels} labels; a reward model has one (num_labels=1): its single logit is the reward")
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json",
                                                                "tokenizer.model", "vocab.json")):
        problems.append(f"{where} has no tokenizer files: save the reward model's tokenizer into the same directory")
    return problems


def has_chat_template(path: str) -> bool:
    """Whether the model directory's tokenizer carries a chat template (config or chat_template.jinja)."""
    if os.path.isfile(os.path.join(path, "chat_template.jinja")) or os.path.isfile(os.path.join(path, "chat_template.json")):
        return True
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            return bool(json.load(f).get("chat_template"))
    except (OSError, ValueError):
        return False
