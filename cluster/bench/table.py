"""The table `raygrpo bench` prints (and keeps in its JSON), from the results dict: one row per
measure, (part, measure, value, unit / note), missing parts left out or shown as n/a. Each part's rows
come from its own function (TABLE_PARTS, at the end); rich draws the table."""
from __future__ import annotations

import math
from collections.abc import Callable

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from cluster.bench import cross_host, pipeline_summary, rewards
from cluster.bench.report import ratio


def fmt_value(v) -> str:
    """A number for humans: 3 significant digits, thousands separators for big ones."""
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "n/a"
        a = abs(v)
        if a >= 10000:
            return f"{v:,.0f}"
        if a >= 100:
            return f"{v:.0f}"
        if a >= 10:
            return f"{v:.1f}"
        if a >= 1:
            return f"{v:.2f}"
        if a == 0:
            return "0"
        return f"{v:.3g}"
    return str(v)


def markdown_table(headers: tuple, rows: list[list[str]], right: tuple[int, ...] = ()) -> str:
    """Rows of text as an aligned Markdown table, drawn by rich: the columns in `right` right-aligned, with
    Markdown's `---:` under their header so that a rendered copy (docs/benchmarks.md) aligns them too."""
    table = Table(box=box.MARKDOWN, show_edge=True)
    for i, header in enumerate(headers):
        table.add_column(Text(str(header)), justify="right" if i in right else "left", no_wrap=True)
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))  # Text: a "[...]" in a note is not rich markup
    console = Console(width=100_000, color_system=None, emoji=False, highlight=False)  # never wrapped
    with console.capture() as captured:
        console.print(table)
    lines = [line.rstrip() for line in captured.get().splitlines() if line.strip()]  # box.MARKDOWN's blank edges
    rule = lines[1].split("|")  # "", then one run of dashes per column, then ""
    lines[1] = "|".join(cell[:-1] + ":" if i - 1 in right else cell for i, cell in enumerate(rule))
    return "\n".join(lines)


def format_table(rows: list[tuple], headers: tuple = ("part", "measure", "value", "unit / note")) -> str:
    """Rows of (part, measure, value, note) as an aligned text table (also valid Markdown)."""
    return markdown_table(headers, [[str(c) if i != 2 else fmt_value(c) for i, c in enumerate(r)] for r in rows],
                          right=(2,))


def _best_vs_best(res: dict, schedules: dict) -> tuple:
    """raygrpo's faster schedule against TRL's faster thread count: the comparison a user makes."""
    ours = {m: s["step_s_median"] for m, s in schedules.items() if s and s.get("step_s_median")}
    trls = {res[k].get("torch_threads"): res[k]["step_s_median"] for k in res
            if (k == "trl" or k.startswith("trl_")) and res[k].get("status") == "ok" and res[k].get("step_s_median")}
    if not ours or not trls:
        return ("5 vs TRL", "best raygrpo / best TRL", None, "needs a schedule and a TRL run")
    mode, threads = min(ours, key=ours.get), min(trls, key=trls.get)
    return ("5 vs TRL", "best raygrpo / best TRL", ratio(ours[mode], trls[threads]),
            f"raygrpo {mode} vs TRL" + (f" with {threads} thread(s)" if threads else "")
            + ", medians (< 1: raygrpo faster)")


def model_rows(res: dict) -> list[tuple]:
    m = res.get("model", {})
    if not m:
        return []
    return [("model", "parameters", m.get("parameters"), f"hidden {m.get('hidden_size')}, {m.get('num_layers')} layers, "
             "float32" + (", random weights; --setting long" if res.get("setting", {}).get("name") == "long" else ""))]


def rollout_rows(res: dict) -> list[tuple]:
    """Part 1: tokens/s through vLLM directly, the RolloutWorker in process and through Ray."""
    ro = res.get("rollout")
    if not ro:
        return []
    note = f"{ro['prompts']} prompts x G={ro['group_size']} x <= {ro['max_new_tokens']} tokens, {ro['threads']} thread(s)"
    return [
        ("1 rollout", "vLLM direct (llm.generate)", ro["direct"]["tokens_per_s"], "tokens/s; " + note),
        ("1 rollout", "RolloutWorker, no Ray", ro["wrapper"]["tokens_per_s"], "tokens/s (same class, in-process)"),
        ("1 rollout", "RolloutWorker via Ray", ro["actor"]["tokens_per_s"], "tokens/s (Ray actor call)"),
        ("1 rollout", "Ray actor / direct", ro["actor_vs_direct"], "ratio (1.0 = no overhead)"),
        ("1 rollout", "same tokens generated", ro["same_tokens"], f"{ro['actor']['tokens_per_call']} tokens per call"),
    ]


def sync_rows(res: dict) -> list[tuple]:
    """Part 2: a full weight update under ZeRO-2 and ZeRO-3, the raw broadcast of the same bytes, sync's share."""
    rows: list[tuple] = []
    for key, label in (("sync", "ZeRO-2"), ("sync_zero3", "ZeRO-3")):
        sy = res.get(key)
        if not sy:
            continue
        rows += [
            ("2 sync", f"full update ({label}) seconds", sy["seconds"],
             f"{sy['bytes'] / 2**20:.2f} MiB, learner -> vLLM, {sy.get('backend', 'gloo')}"
             + (f" ({sy['transport']})" if sy.get("transport") not in (None, sy.get("backend")) else "")),
            ("2 sync", f"full update ({label}) MB/s", ratio(sy["bytes"], sy["seconds"] * 1e6), "through vLLM's RL API"),
        ]
        if sy.get("parts"):
            rows.append(("2 sync", f"parts ({label}), ms", "-",
                         ", ".join(f"{k.removesuffix('_s')} {1000 * v:.1f}" for k, v in sy["parts"].items())))
    raw = res.get("raw_broadcast")
    if raw:
        rows += [
            ("2 sync", "raw gloo broadcast seconds", raw["seconds"], "one flat tensor, same bytes, 2 processes"),
            ("2 sync", "raw gloo broadcast MB/s", ratio(raw["bytes"], raw["seconds"] * 1e6), ""),
            ("2 sync", "full update / raw broadcast", ratio(res.get("sync", {}).get("seconds"), raw["seconds"]),
             "time ratio (1.0 = no overhead)"),
        ]
    sc = res.get("schedules", {})
    if sc.get("sync"):
        rows.append(("2 sync", "sync share of a step", sc["sync"].get("sync_share"), "sync_s / step_s, sync schedule"))
    return rows


def schedule_rows(res: dict) -> list[tuple]:
    """Part 3: the sync and async schedules' step times, and how much of the ideal overlap async reaches."""
    rows: list[tuple] = []
    sc = res.get("schedules", {})
    for mode in ("sync", "async"):
        s = sc.get(mode)
        if s:
            rows.append(("3 schedule", f"{mode} step (median)", s.get("step_s_median"),
                         f"s/step of {s.get('steps_measured')} after warm-up (mean {fmt_value(s.get('step_s'))}, min "
                         f"{fmt_value(s.get('step_s_min'))}); mean gen side {fmt_value(s.get('gen_side_s'))}, learner side "
                         f"{fmt_value(s.get('learner_side_s'))}"))
    if sc.get("sync") and sc.get("async"):
        a = sc["async"]
        rows += [
            ("3 schedule", "async / sync step time", ratio(a.get("step_s_median"), sc["sync"].get("step_s_median")),
             "ratio of medians (< 1: overlap pays)"),
            ("3 schedule", "async: max(gen, learner side)", a.get("ideal_overlap_s"),
             f"mean s/step, the ideal overlap (max(gen, train) alone: {fmt_value(a.get('max_gen_train_s'))})"),
            ("3 schedule", "async: ideal / measured", a.get("overlap_efficiency"), "of the means; 1.0 = perfect overlap"),
        ]
    return rows


def learner_rows(res: dict) -> list[tuple]:
    """Part 4: the learner's completion tokens/s under each ZeRO stage."""
    return [("4 learner", f"{stage} ({lr['ranks']} rank(s))", lr["tokens_per_s"],
             f"completion tokens/s; {lr['seq']} seqs, {lr['steps']} steps after warm-up; "
             f"~{fmt_value(lr['gflops'])} GFLOP/s" + (f", MFU {lr['mfu']:.1%}" if lr.get("mfu") else ""))
            for stage, lr in sorted(res.get("learner", {}).items())]


def trl_rows(res: dict) -> list[tuple]:
    """Part 5: raygrpo's schedules against TRL's GRPOTrainer: step times, rewards, held-out accuracy."""
    t = res.get("trl")
    if not t:
        return []
    if t.get("status") != "ok":
        return [("5 vs TRL", "TRL GRPOTrainer", None, f"{t.get('status')}: {t.get('message', '')}"[:120])]
    sc = res.get("schedules", {})
    ours, asy, th = sc.get("sync", {}), sc.get("async", {}), t.get("torch_threads")
    rows = [
        ("5 vs TRL", "raygrpo s/step (sync, median)", ours.get("step_s_median"),
         f"min {fmt_value(ours.get('step_s_min'))}; Ray + vLLM + DeepSpeed + weight sync, thread budget"),
        ("5 vs TRL", f"TRL s/step ({th} thread, median)", t.get("step_s_median"),
         f"min {fmt_value(t.get('step_s_min'))}; GRPOTrainer, HF generate, one process"),
        ("5 vs TRL", "raygrpo / TRL step time", ratio(ours.get("step_s_median"), t.get("step_s_median")),
         "ratio of medians (< 1: raygrpo faster)"),
    ]
    if asy:
        rows.append(("5 vs TRL", f"raygrpo async / TRL ({th} thread)",
                     ratio(asy.get("step_s_median"), t.get("step_s_median")), "ratio of medians, async schedule"))
    for key in sorted(k for k in res if k.startswith("trl_") and res[k].get("status") == "ok"):
        n = res[key].get("torch_threads")
        rows.append(("5 vs TRL", f"TRL s/step ({n} threads, median)",
                     res[key].get("step_s_median"), f"min {fmt_value(res[key].get('step_s_min'))}; the same run, "
                     "more torch threads"))
        for mode, s in (("sync", ours), ("async", asy)):
            if s:
                rows.append(("5 vs TRL", f"raygrpo {mode} / TRL ({n} threads)",
                             ratio(s.get("step_s_median"), res[key].get("step_s_median")), "ratio of medians"))
    rows.append(_best_vs_best(res, {"sync": ours, "async": asy}))
    rows += [
        ("5 vs TRL", "raygrpo batch reward, last step", ours.get("reward_last"),
         f"step 1: {fmt_value(ours.get('reward_first'))}; same prompts per step as TRL"),
        ("5 vs TRL", "TRL batch reward, last step", t.get("reward_last"), f"step 1: {fmt_value(t.get('reward_first'))}"),
    ]
    return rows + _heldout_rows(res.get("heldout"))


def _heldout_rows(h: dict | None) -> list[tuple]:
    if not h:
        return []
    n = h.get("prompts")
    return [
        ("5 vs TRL", "held-out accuracy, start", h.get("before"), f"greedy, {n} unseen prompts, HF generate"),
        ("5 vs TRL", "held-out accuracy, raygrpo", h.get("raygrpo_after"), "after the steps"),
        ("5 vs TRL", "held-out accuracy, TRL", h.get("trl_after"), "after the steps"),
    ]


def lora_rows(res: dict) -> list[tuple]:
    """Part 6's rows of the table (cluster/bench/lora.py measures them)."""
    lo = res.get("lora")
    if not lo or "full" not in lo:
        return []
    full = lo["full"]
    rows = []
    for name in ("full", "adapter", "merged"):
        v = lo.get(name)
        if v:
            rows.append(("6 lora", f"sync {name} seconds", v["seconds"],
                         f"{v['bytes'] / 2**20:.3f} MiB ({v['bytes'] / full['bytes']:.1%} of full), "
                         f"{v['trainable_params']:,} trainable params"))
    if lo.get("adapter"):
        rows.append(("6 lora", "optimizer state LoRA / full", lo["adapter"]["optimizer_state_bytes"] / full["optimizer_state_bytes"],
                     f"{lo['adapter']['optimizer_state_bytes'] / 2**20:.3f} vs {full['optimizer_state_bytes'] / 2**20:.3f} MiB "
                     f"(Adam moments + fp32 partitions, ZeRO-2, 1 rank, rank {lo['lora_rank']})"))
    return rows


# The table's parts, in the order it prints them: a new bench part is its module's rows function (results dict ->
# (part, measure, value, note) rows, none when the part did not run) and one line here.
TABLE_PARTS: tuple[Callable[[dict], list[tuple]], ...] = (
    model_rows,
    rollout_rows,
    sync_rows,
    schedule_rows,
    learner_rows,
    trl_rows,
    lora_rows,
    rewards.table_rows,
    cross_host.table_rows,
    pipeline_summary.table_rows,
)


def table_rows(res: dict) -> list[tuple]:
    """The printed table, from the results dict: every part's rows in TABLE_PARTS order (missing parts are left
    out or shown as n/a)."""
    return [row for part_rows in TABLE_PARTS for row in part_rows(res)]
