"""What a kind of `reward.functions` entry is (`RewardKind`), what it starts (`KindRunner`), and what
every kind works on and fills while one batch is scored (`Batch`, `Tally`, `FunctionStats`).

Adding a kind is one module with a RewardKind and its KindRunner, and one line in registry.py's
KINDS: the scorer, the config check, metric names and the progress lines all ask the kind.

Deliberately light (no torch, no Ray): the driver checks a config before anything heavy starts.
"""
from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from actors.config import RewardConfig

NAN = float("nan")
# No "/" in a name: TensorBoard and W&B nest a tag's parts as folders (rewards/127.0.0.1/verify/mean).
_TAG_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")


def safe_name(name: str) -> str:
    """A reward function's one name (metrics, completions.jsonl, `raygrpo show`, TensorBoard, W&B): the
    characters TensorBoard takes in a tag, without "/" (127.0.0.1/verify -> 127.0.0.1_verify)."""
    return _TAG_UNSAFE.sub("_", name) or "reward"


def is_error(v) -> bool:
    return isinstance(v, float) and math.isnan(v)


def trl_completion(prompt, text: str):
    """What TRL passes as a completion: the text, or for a conversation one assistant message."""
    return [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text


def columns(idx: list[int], ids: list, fields: list[dict]) -> dict:
    """Per-sample fields as TRL's column lists (a column a row lacks is None there)."""
    keys = list(dict.fromkeys(k for i in idx for k in fields[i]))
    cols = {k: [fields[i].get(k) for i in idx] for k in keys}
    if all(ids[i] is not None for i in idx):
        cols["completion_ids"] = [ids[i] for i in idx]
    return cols


@dataclass
class FunctionStats:
    """One reward function over one batch (summed over a step's batches by the driver)."""

    values: list[float] = field(default_factory=list)  # the values it gave (errors and nulls not included)
    errors: int = 0  # samples it failed on (raised, timed out, non-number, process died)
    unscorable: int = 0  # samples it returned null for
    calls: int = 0  # calls made (per sample, per chunk, per request, per model batch)
    timeouts: int = 0  # calls that ran out of time
    seconds: float = 0.0  # from the start of scoring until its last value came back
    truncated: int | None = None  # reward models: inputs cut to reward.model_max_len (None: not a model)
    first_error: str | None = None  # the text of its first error in this batch (what a halt names it with)

    @property
    def failed_every_call(self) -> bool:
        """It gave no value and no null: every sample it was given ended in an error."""
        return self.errors > 0 and not self.values and not self.unscorable


@dataclass
class Batch:
    """One batch as every kind sees it: per sample the prompt, the completion's text, its token ids
    (None when unknown, e.g. a multi-turn trajectory) and the keyword fields a function may take."""

    prompts: list
    texts: list[str]
    ids: list
    fields: list[dict]

    def __len__(self) -> int:
        return len(self.texts)


class Tally:
    """What the functions gave for one batch: per spec and sample a float, None (null) or NaN (error,
    until a value is recorded), per spec its FunctionStats, and the error messages in the order they came."""

    def __init__(self, specs: list[str], n: int, names: dict[str, str]):
        self.values = {s: [NAN] * n for s in specs}
        self.stats = {s: FunctionStats() for s in specs}
        self.errors: list[str] = []
        self.tests: list[list[dict] | None] = [None] * n  # per sample, a code reward's per-test outcomes
        self.names = names
        self.t0 = time.monotonic()

    def record(self, spec: str, i: int, ok: bool, value) -> None:
        if ok:
            self.values[spec][i] = value
        else:
            self.errors.append(f"{self.names.get(spec, spec)} on sample {i}: {value}")
            if self.stats[spec].first_error is None:
                self.stats[spec].first_error = str(value)


class KindRunner:
    """A kind's entries of one scorer, started: its processes, clients or actor handles."""

    names: dict[str, str] = {}  # spec -> the name its code gives itself (a Python function's __name__)
    restarts: int = 0  # times its actors were restarted under it (a call answered by a new process)

    def send(self, specs: list[str], batch: Batch, tally: Tally, progress) -> Callable[[], None]:
        """Start scoring `batch` with `specs` and return `wait`, which records what is left into `tally`.
        Work that runs elsewhere (threads, actors) is sent here and collected by `wait`; work done on the
        caller's thread or its processes is done here (the scorer sends to every kind before it waits)."""
        raise NotImplementedError

    def attach(self, spec: str, handle, timeout_s: float) -> None:
        """The actor the driver started for `spec` (RewardKind.actor_path), waited on at most timeout_s."""
        raise TypeError(f"the reward function {spec} takes no actor")

    def restarted_actors(self) -> list[str]:
        """The entries whose actor answered from a new process (Ray restarted it) since the last call."""
        return []

    def close(self) -> None:
        pass


class RewardKind:
    """One kind of `reward.functions` entry. A subclass overrides what differs from these defaults."""

    name = ""  # "python", "model", "http": the key in registry.KINDS
    form = ""  # how a user writes one, for the error on an entry no kind recognises
    stats: tuple[str, ...] = ()  # metrics it reports beyond scorer.REWARD_STATS (a reward model: "truncated")
    judges = False  # its 1.0 is a verdict of correctness (held-out evaluation asks it, as the answer checkers)

    def recognises(self, spec: str) -> bool:
        raise NotImplementedError

    def resolve(self, spec: str) -> str:
        """The entry as it crosses into another process (paths made absolute)."""
        return spec

    def default_name(self, spec: str, loaded: dict[str, str]) -> str:
        """Its metric name unless reward.names gives one; `loaded`: spec -> the name its code gives itself."""
        return safe_name(spec)

    def problems(self, spec: str) -> list[str]:
        """What is wrong with the entry, found without starting anything."""
        return []

    def data_problems(self, spec: str, chat: bool) -> list[str]:
        """What keeps it from scoring the run's data (chat: the prompts are messages)."""
        return []

    def timeout_setting(self, spec: str, cfg: RewardConfig) -> str | None:
        """The setting that bounds one of its calls ("reward.timeout_s=10"), if any."""
        return None

    def actor_path(self, spec: str) -> str | None:
        """The model directory the driver starts an actor with for this entry (then `attach`es it); None: no actor."""
        return None

    def start(self, specs: list[str], cfg: RewardConfig) -> KindRunner:
        """Its entries of one scorer (resolved), started; `specs` may be empty (an evaluation's checker)."""
        raise NotImplementedError
