"""Bad configs a user could write, and what the config check says about each (issue 60 item 6).

Each case is a YAML file and/or dotted overrides, the config keys its problems must name, and the
did-you-mean each must offer where there is one. tests/unit/test_bad_configs.py holds the check to
them; docs/config-errors.md is the table of what the check printed before pydantic took over the
coercion and after. Run it to print what the check says today, as the table's rows:

    .venv/bin/python tests/bad_configs.py            # markdown rows: case, input, problems
    .venv/bin/python tests/bad_configs.py --json F   # {case: [problem, ...]} into F

The check is `load_config(path, overrides, validate_paths=False)`, what every command runs first
(`raygrpo submit` and `raygrpo score` with exactly these arguments; `raygrpo train` adds the file
checks of model.path and the data, left out here so that no case needs a model directory).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__":  # run as a script: the project root, as pytest's rootdir gives it
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cluster.config import ConfigError, load_config  # noqa: E402


@dataclass(frozen=True)
class BadConfig:
    name: str
    yaml: str | None  # the config file's text; None: no file, overrides only
    overrides: tuple[str, ...]
    keys: tuple[str, ...]  # what the problems must name (config keys, or the override as written)
    did_you_mean: tuple[str, ...] = ()  # keys the problems must offer instead (did you mean / raygrpo calls it)


CASES = [
    # wrong types
    BadConfig("word for an int", None, ("trainer.steps=ten",), ("trainer.steps",)),
    BadConfig("bool for an int", None, ("trainer.steps=true",), ("trainer.steps",)),
    BadConfig("fraction for an int", None, ("trainer.group_size=8.5",), ("trainer.group_size",)),
    BadConfig("word for a float (YAML)", "learner:\n  lr: fast\n", (), ("learner.lr",)),
    BadConfig("number for a bool", None, ("metrics.wandb=1",), ("metrics.wandb",)),
    BadConfig("number for a string", None, ("trainer.mode=1",), ("trainer.mode",)),
    BadConfig("string where a list belongs", None, ("rollout.stop=</s>",), ("rollout.stop",)),
    BadConfig("list where a scalar belongs", None, ("trainer.steps=[10, 20]",), ("trainer.steps",)),
    BadConfig("a list item of the wrong type", None, ("reward.weights=[1.0, heavy]",), ("reward.weights",)),
    BadConfig("mapping where a scalar belongs", "learner:\n  lr: {value: 1.0e-5}\n", (), ("learner.lr",)),
    BadConfig("int-or-auto given a fraction", None, ("learner.zero_stage=2.5",), ("learner.zero_stage",)),
    BadConfig("number-or-null given a word", None, ("algo.tis_cap=high",), ("algo.tis_cap",)),
    BadConfig("list where a mapping belongs", None, ("data.chat_template_kwargs=[enable_thinking]",),
              ("data.chat_template_kwargs",)),
    # the file's shape
    BadConfig("a section that is a number", "trainer: 50\n", (), ("trainer",)),
    BadConfig("YAML that is a list", "- trainer.steps: 5\n- learner.lr: 1.0e-5\n", (), ("config",)),
    BadConfig("YAML that is one string", "just some text\n", (), ("config",)),
    # unknown keys
    BadConfig("a typo in a section", None, ("trainer.stepz=3",), ("trainer.stepz",), ("trainer.steps",)),
    BadConfig("a key in the wrong section", None, ("trainer.lr=1e-6",), ("trainer.lr",), ("learner.lr",)),
    BadConfig("a section misspelt", "trainers:\n  steps: 2\n", (), ("trainers",), ("trainer",)),
    BadConfig("TRL's flat key", None, ("beta=0.04",), ("beta",), ("algo.beta",)),
    BadConfig("TRL's num_generations", "num_generations: 8\n", (), ("num_generations",), ("trainer.group_size",)),
    BadConfig("TRL's learning_rate", None, ("learning_rate=1e-6",), ("learning_rate",), ("learner.lr",)),
    BadConfig("verl's dotted key", None, ("actor_rollout_ref.rollout.n=8",), ("actor_rollout_ref.rollout.n",),
              ("trainer.group_size",)),
    BadConfig("verl's nested YAML", "algorithm: {adv_estimator: grpo}\nactor_rollout_ref:\n  actor: {optim: {lr: 1.0e-6}}\n",
              (), ("algorithm.adv_estimator", "actor_rollout_ref.actor.optim.lr"),
              ("algo.advantage_estimator", "learner.lr")),
    BadConfig("an unknown key close to nothing", None, ("trainer.xyzzy=1",), ("trainer.xyzzy",)),
    # values out of range, impossible combinations
    BadConfig("a negative temperature", None, ("rollout.temperature=-1",), ("rollout.temperature",)),
    BadConfig("a group of one", None, ("trainer.group_size=1",), ("trainer.group_size",)),
    BadConfig("NaN learning rate", None, ("learner.lr=.nan",), ("learner.lr",)),
    BadConfig("a choice misspelt", None, ("trainer.mode=asynch",), ("trainer.mode",)),
    BadConfig("a combination the schedule refuses", None, ("trainer.mode=pipeline", "trainer.eval_every=5"),
              ("trainer.eval_every",)),
    # the command line's dotted overrides
    BadConfig("an override without =", None, ("trainer.steps",), ("trainer.steps",)),
    BadConfig("an override into a scalar", "trainer:\n  steps: 5\n", ("trainer.steps.max=5",), ("trainer.steps",)),
    BadConfig("an override whose value is not YAML", None, ("rollout.stop=[a, b",), ("rollout.stop",)),
    BadConfig("an override with a comment", None, ("trainer.steps=50 # fifty",), ("trainer.steps",)),
    BadConfig("an override that sets a section", None, ("trainer=5",), ("trainer",)),
    # several at once: every problem in one round
    BadConfig("five problems at once", "trainer: {group_size: 1, stepz: 3}\nlearner: {lr: fast}\n",
              ("learner.num_ranks=3", "rollout.temperature=-1"),
              ("trainer.group_size", "trainer.stepz", "learner.lr", "learner.num_ranks", "rollout.temperature"),
              ("trainer.steps",)),
]


def check(case: BadConfig, directory: Path) -> list[str]:
    """The problems the config check lists for `case` ([] when it accepts it)."""
    path = None
    if case.yaml is not None:
        path = directory / (re.sub(r"\W+", "_", case.name) + ".yaml")
        path.write_text(case.yaml)
    try:
        load_config(path, list(case.overrides), validate_paths=False)
    except ConfigError as e:
        return list(e.problems)
    return []


def named_keys(problems: list[str]) -> list[str]:
    """The dotted keys (and unknown top-level names) a list of problems names, in order, once each."""
    found = []
    for line in problems:
        found += re.findall(r"^([\w.]+)(?:\[\d+\])?: ", line)  # `trainer.steps: expected ...`, `config: ...`
        found += re.findall(r"unknown key (\S+?):?(?=\s|$)", line)
        found += re.findall(r"(?<![\w./-])([a-z_]{2,}(?:\.[a-z_]{2,})+)(?!\.?\w)", line)
    return list(dict.fromkeys(found))


def given(case: BadConfig) -> str:
    """A case's input as a markdown cell: the file's text on one line, then the overrides."""
    parts = ([f"file `{case.yaml.strip().replace(chr(10), ' / ')}`"] if case.yaml else []) + [f"`{o}`" for o in case.overrides]
    return " ".join(parts).replace("|", "\\|")


def cell(problems: list[str]) -> str:
    """Problems as one markdown cell (YAML's own errors span lines; a | would end the cell)."""
    return " <br> ".join(" ".join(p.split()) for p in problems).replace("|", "\\|") or "ACCEPTED"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write {case: [problem, ...]} to this file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        said = {case.name: check(case, Path(d)) for case in CASES}
    if args.json:
        Path(args.json).write_text(json.dumps(said, indent=1) + "\n")
    for i, case in enumerate(CASES, 1):
        print(f"| {i} | {case.name} | {given(case)} | {cell(said[case.name])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
