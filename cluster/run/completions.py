"""Sample completions, logged: what the model wrote, how each reward function scored it.

A few completions per step (`metrics.log_completions`, `metrics.completions_per_step`) are
picked while a batch is scored, one per prompt in turn, so they span the step's prompts. Each
is one row of `completions.jsonl` in the run dir (and a TensorBoard text summary, a W&B table):

    {"step": 3, "prompt_index": 0, "sample": 1, "prompt": ..., "completion": "...", "reward": 1.0,
     "rewards": {"gsm8k": 1.0}, "advantage": 0.87, "finish_reason": "stop", "num_tokens": 23}

`prompt` is the dataset's prompt as it is (a string or chat messages). Multi-turn rows add
`messages` (the whole transcript, roles included), `turns`, `env_reward` and `env_error`. A code reward
(`code_tests`) adds `tests`: per test {"test", "outcome", "detail"}, outcome passed | failed | error |
timeout | memory | output_limit. With
trainer.mode=pipeline a row adds `versions`: per completion token, the weight version that sampled it.
`raygrpo show RUN_DIR` prints them (`format_row`).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from cluster.run.jsonl import read_jsonl, torn_note

COMPLETIONS_FILE = "completions.jsonl"


def pick(groups: int, group_size: int, k: int) -> list[tuple[int, int]]:
    """k (group, sample) pairs: sample 0 of each group in turn, then sample 1 of each, ...: a few
    completions that span as many prompts as possible."""
    return [(i % groups, i // groups) for i in range(min(k, groups * group_size))] if groups else []


def finite_or_none(v) -> float | None:
    """A number as JSON should hold it: a finite float, else None (null)."""
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def sample_rows(live: list, rewards: list[float], per_function: dict[str, list[float]], advantages: list[float] | None,
                group_size: int, k: int, tests: list | None = None) -> list[dict]:
    """Rows for k completions of one scored round. `live`: (example, rollout) pairs, the rollout's
    completions G each; `rewards`, `advantages`, every `per_function[name]` and `tests` (a code reward's
    per-test outcomes, RewardResult.tests) run over all of them in order (completion j of group g at
    g * G + j). A function's NaN (its call failed) is null. `advantages` None: each row's "advantage" is None
    until the batch that trains it fills it in (cluster/driver/batch.py Batch.from_groups)."""
    rows = []
    for g, j in pick(len(live), group_size, k):
        example, rollout = live[g]
        c, at = rollout.completions[j], g * group_size + j
        row = {"prompt_index": g, "sample": j, "prompt": example.prompt, "completion": c.text,
               "reward": finite_or_none(rewards[at]), "rewards": {name: finite_or_none(v[at]) for name, v in per_function.items()},
               "advantage": finite_or_none(advantages[at]) if advantages is not None else None,
               "finish_reason": c.finish_reason}
        if hasattr(c, "messages"):  # a multi-turn trajectory (actors/multiturn/trajectories.py)
            row |= {"num_tokens": sum(c.loss_mask), "messages": c.messages, "turns": c.turns,
                    "env_reward": c.env_reward, "env_error": c.env_error}
        else:
            row["num_tokens"] = len(c.token_ids)
        if tests and tests[at] is not None:  # code_tests: [{"test", "outcome", "detail"}]
            row["tests"] = tests[at]
        if getattr(c, "versions", None) is not None:  # trainer.mode=pipeline: per token, the version that sampled it
            row["versions"] = c.versions
        rows.append(row)
    return rows


def write_rows(run_dir: str | Path, step: int, rows: list[dict]) -> None:
    with open(Path(run_dir) / COMPLETIONS_FILE, "a") as f:
        for row in rows:
            f.write(json.dumps({"step": step, **row}, default=str) + "\n")


def read_rows(run_dir: str | Path) -> tuple[list[dict], list[int]]:
    """(every logged completion, the numbers of the lines skipped as torn: cut short by a crash)."""
    return read_jsonl(Path(run_dir) / COMPLETIONS_FILE)


# --------------------------------------------------------------------------- reading them


def _messages_text(messages: list[dict], indent: str = "  ") -> str:
    return "\n".join(f"{indent}[{m.get('role', '?')}] " + str(m.get("content", "")).replace("\n", "\n" + indent + "  ")
                     for m in messages)


def _indent(text: str, indent: str = "  ") -> str:
    return indent + str(text).replace("\n", "\n" + indent)


def headline(row: dict) -> str:
    """'reward 1.000 (gsm8k 1.000) | advantage +0.866 | stop, 23 tokens'"""
    def num(v, fmt):
        return "error" if v is None else format(v, fmt)

    parts = [f"{name} {num(v, '.3f')}" for name, v in row.get("rewards", {}).items()]
    if row.get("env_reward") is not None and "messages" in row:
        parts.append(f"environment {row['env_reward']:.3f}")
    text = f"reward {num(row.get('reward'), '.3f')}" + (f" ({', '.join(parts)})" if parts else "")
    text += f" | advantage {num(row.get('advantage'), '+.3f')} | {row.get('finish_reason')}, {row.get('num_tokens')} tokens"
    if "turns" in row:
        text += f", {row['turns']} turn(s)"
    if row.get("env_error"):
        text += f" | environment error: {row['env_error']}"
    return text


def format_row(row: dict) -> str:
    """One logged completion, readable in a terminal: the prompt, what the model wrote (the whole
    transcript with roles for a multi-turn one), and how it was scored."""
    out = [f"--- step {row['step']}, prompt {row['prompt_index'] + 1}, sample {row['sample'] + 1}: {headline(row)}"]
    if "messages" in row:
        out += ["transcript:", _messages_text(row["messages"])]
        return "\n".join(out)
    prompt = row["prompt"]
    out.append("prompt:")
    out.append(_messages_text(prompt) if isinstance(prompt, list) else _indent(prompt))
    out += ["completion:", _indent(row["completion"])]
    if row.get("tests"):
        out += ["tests:", *test_lines(row["tests"])]
    return "\n".join(out)


def test_lines(tests: list[dict], indent: str = "  ") -> list[str]:
    """A code reward's per-test outcomes, one line each: '  failed   assert add(1, 2) == 3: AssertionError'."""
    return [f"{indent}{t.get('outcome', '?'):<12} {t.get('test', '')}"
            + (f": {t['detail']}" if t.get("detail") else "") for t in tests]


def markdown(rows: list[dict]) -> str:
    """The TensorBoard text summary of a step's rows (TensorBoard renders markdown)."""
    parts = []
    for row in rows:
        body = (_messages_text(row["messages"], "") if "messages" in row else
                (_messages_text(row["prompt"], "") if isinstance(row["prompt"], list) else str(row["prompt"]))
                + "\n[completion] " + str(row["completion"]))
        parts.append(f"**prompt {row['prompt_index'] + 1}, sample {row['sample'] + 1}**: {headline(row)}\n\n"
                     + "\n".join("    " + line for line in body.splitlines()))
    return "\n\n".join(parts)


def table(rows: list[dict]) -> tuple[list[str], list[list]]:
    """(columns, data) for a W&B table: one column per reward function, as TRL's completions table."""
    functions = list(dict.fromkeys(name for row in rows for name in row.get("rewards", {})))
    columns = ["step", "prompt", "completion", "reward", *functions, "advantage", "finish_reason", "num_tokens"]
    data = []
    for row in rows:
        prompt = _messages_text(row["prompt"], "") if isinstance(row["prompt"], list) else str(row["prompt"])
        completion = _messages_text(row["messages"], "") if "messages" in row else row["completion"]
        data.append([row["step"], prompt, completion, row.get("reward"), *(row["rewards"].get(f) for f in functions),
                     row.get("advantage"), row.get("finish_reason"), row.get("num_tokens")])
    return columns, data


def show(run_dir: str | Path, step: int | None, n: int | None, out=print) -> None:
    """`raygrpo show`: the completions logged at `step` (default: the last step that has any)."""
    run_dir = Path(run_dir)
    rows, torn = read_rows(run_dir)
    if torn:  # a partly lost step must not look complete
        out(torn_note(run_dir / COMPLETIONS_FILE, torn))
    if not rows:
        why = "no such directory" if not run_dir.is_dir() else f"no {COMPLETIONS_FILE} there"
        raise FileNotFoundError(f"{run_dir}: {why}. `raygrpo train` writes it with metrics.log_completions=true "
                                "(the default); point at a run dir")
    steps = sorted({r["step"] for r in rows})
    step = steps[-1] if step is None else step
    picked = [r for r in rows if r["step"] == step]
    if not picked:
        raise FileNotFoundError(f"{run_dir}/{COMPLETIONS_FILE} has no completions of step {step}; logged steps: "
                                f"{_ranges(steps)}")
    shown = picked if n is None else picked[:n]
    out(f"{run_dir}: step {step}, {len(shown)} of {len(picked)} logged completion(s) (steps logged: {_ranges(steps)})"
        + (f"; {len(torn)} torn line(s) skipped, so a step may miss some" if torn else ""))
    for row in shown:
        out("")
        out(format_row(row))


def _ranges(steps: list[int]) -> str:
    """[1, 2, 3, 5] -> '1-3, 5'"""
    out, start = [], None
    for i, s in enumerate(steps):
        start = s if start is None else start
        if i + 1 == len(steps) or steps[i + 1] != s + 1:
            out.append(str(s) if s == start else f"{start}-{s}")
            start = None
    return ", ".join(out)
