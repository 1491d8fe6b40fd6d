"""`raygrpo bench`'s pure parts: ratios, step summaries, the table, the JSON (no Ray, no vLLM)."""
import json
import math
import os
import subprocess
import sys

import pytest

from cluster import bench
from cluster.bench import command, learner_sync, report, rollout, schedule, table, trl  # noqa: F401
from cluster.cli import build_parser
from cluster.config import load_config


def test_ratio_handles_missing_and_zero():
    assert report.ratio(6, 3) == 2.0
    assert report.ratio(None, 3) is None and report.ratio(3, None) is None
    assert report.ratio(3, 0) is None
    assert report.ratio(float("nan"), 1) is None
    assert report.per_second(1000, 0.5) == 2000.0


def test_mean_skips_missing_values():
    assert report.mean([1, None, 3, float("nan")]) == 2.0
    assert report.mean([]) is None


def _row(step, gen, rew, train, sync, step_s, ref=0.0, tokens=100, reward=0.5):
    return {"kind": "train", "step": step, "gen_s": gen, "reward_s": rew, "ref_s": ref, "train_s": train,
            "sync_s": sync, "step_s": step_s, "gen_tokens": tokens, "reward_mean": reward}


def test_schedule_summary_skips_warmup_and_computes_overlap():
    rows = [_row(1, 9.0, 0.0, 9.0, 9.0, 30.0, reward=0.1),  # warm-up: left out of the timings
            _row(2, 1.0, 0.5, 2.0, 0.5, 3.0, reward=0.2),
            _row(3, 3.0, 0.0, 1.0, 0.5, 4.0, reward=0.4)]
    s = report.schedule_summary(rows, skip=1)
    assert s["steps_measured"] == 2
    assert s["step_s"] == pytest.approx(3.5)
    assert s["step_s_median"] == pytest.approx(3.5) and s["step_s_min"] == 3.0
    assert s["gen_side_s"] == pytest.approx((1.5 + 3.0) / 2)
    assert s["learner_side_s"] == pytest.approx((2.5 + 1.5) / 2)
    # per step max(gen side, learner side): max(1.5, 2.5)=2.5, max(3.0, 1.5)=3.0
    assert s["ideal_overlap_s"] == pytest.approx(2.75)
    assert s["max_gen_train_s"] == pytest.approx((2.0 + 3.0) / 2)
    assert s["overlap_efficiency"] == pytest.approx(2.75 / 3.5)
    assert s["sync_share"] == pytest.approx(0.5 / 3.5)
    assert s["gen_tokens_per_s"] == pytest.approx(200 / 4.0)
    # rewards cover every step, warm-up included
    assert s["reward_first"] == 0.1 and s["reward_last"] == 0.4 and s["reward_mean"] == pytest.approx(0.7 / 3)


def test_schedule_summary_puts_the_reference_on_the_side_that_ran_it():
    rows = [_row(1, 9.0, 0.0, 9.0, 9.0, 30.0), _row(2, 1.0, 0.0, 2.0, 0.0, 3.0, ref=1.5)]
    on_learner = report.schedule_summary(rows, skip=1)
    assert (on_learner["gen_side_s"], on_learner["learner_side_s"]) == (1.0, 3.5)
    actor = report.schedule_summary(rows, skip=1, ref_collecting=True)  # the reference actor runs while collecting
    assert (actor["gen_side_s"], actor["learner_side_s"]) == (2.5, 2.0)
    assert actor["ideal_overlap_s"] == 2.5


def test_schedule_summary_single_step_and_eval_rows():
    rows = [{"kind": "eval", "step": 0, "accuracy": 0.5}, _row(1, 1.0, 0.0, 1.0, 0.1, 2.5)]
    s = report.schedule_summary(rows, skip=1)
    assert s["steps_measured"] == 1 and s["step_s"] == 2.5  # one step only: it is all there is
    assert report.schedule_summary([], skip=1) == {}


def test_none_values_in_rows_count_as_zero():
    s = report.schedule_summary([_row(1, 1.0, None, 1.0, None, 2.0), _row(2, 1.0, None, 1.0, None, 2.0)], skip=1)
    assert s["sync_s"] == 0.0 and s["gen_side_s"] == 1.0


@pytest.mark.parametrize("value,text", [
    (None, "n/a"), (True, "yes"), (1234567, "1,234,567"), (12345.6, "12,346"), (123.4, "123"), (12.34, "12.3"),
    (1.234, "1.23"), (0.01234, "0.0123"), (0.0, "0"), (float("inf"), "n/a"), ("x", "x")])
def test_fmt_value(value, text):
    assert table.fmt_value(value) == text


def test_format_table_is_aligned_markdown():
    out = table.format_table([("1 rollout", "direct", 12345.6, "tokens/s"), ("2 sync", "ratio", 1.5, "")])
    lines = out.splitlines()
    assert len(lines) == 4 and len({len(line) for line in lines}) == 1
    assert lines[0].startswith("| part") and set(lines[1]) <= set("|-: ")
    assert "12,346" in lines[2] and "1.50" in lines[3]


def test_format_table_keeps_long_notes_and_brackets_as_written_and_marks_the_value_column_right():
    note = "[bold]not rich markup[/bold]; " + "a long note, " * 20 + "the end"  # wider than any terminal: never wrapped
    lines = table.format_table([("1 rollout", "direct", 1.5, note)]).splitlines()
    assert len(lines) == 3 and lines[2].endswith(f"| {note} |")
    rule = [cell.strip() for cell in lines[1].split("|")[1:-1]]
    assert [cell.endswith(":") for cell in rule] == [False, False, True, False]  # Markdown: value right-aligned
    assert lines[2].split("|")[3] == "  1.50 "  # under "value": right-aligned in the text too


def test_a_new_bench_part_is_its_rows_function_and_one_line_in_table_parts(monkeypatch):
    def toy_rows(res: dict) -> list[tuple]:
        return [("9 toy", "widgets/s", res["toy"]["rate"], "a part added in the test alone")] if "toy" in res else []

    monkeypatch.setattr(table, "TABLE_PARTS", (*table.TABLE_PARTS, toy_rows))
    assert table.table_rows({"toy": {"rate": 42.0}}) == [("9 toy", "widgets/s", 42.0, "a part added in the test alone")]
    assert "| 9 toy | widgets/s |  42.0 |" in table.format_table(table.table_rows({"toy": {"rate": 42.0}}))
    assert table.table_rows({}) == []  # no part ran: no rows


def _fake_results():
    rollout = {"prompts": 32, "group_size": 8, "max_new_tokens": 32, "threads": 1, "same_tokens": True,
               "direct": {"tokens_per_s": 10000.0, "tokens_per_call": 8000},
               "wrapper": {"tokens_per_s": 9000.0, "tokens_per_call": 8000},
               "actor": {"tokens_per_s": 8000.0, "tokens_per_call": 8000}, "actor_vs_direct": 0.8}
    sched = {"sync": {"step_s": 4.0, "step_s_median": 4.0, "sync_share": 0.05, "steps_measured": 4,
                      "reward_first": 0.2, "reward_last": 0.3, "gen_side_s": 1.0, "learner_side_s": 3.0},
             "async": {"step_s": 3.0, "step_s_median": 3.0, "ideal_overlap_s": 2.8, "overlap_efficiency": 2.8 / 3.0,
                       "steps_measured": 4}}
    return {"model": {"parameters": 1_000_000, "hidden_size": 128, "num_layers": 4}, "rollout": rollout,
            "sync": {"seconds": 0.2, "bytes": 4 * 2**20}, "raw_broadcast": {"seconds": 0.05, "bytes": 4 * 2**20},
            "schedules": sched,
            "learner": {"ZeRO-2": {"ranks": 2, "tokens_per_s": 5000.0, "seq": 256, "steps": 3, "gflops": 30.0},
                        "ZeRO-3": {"ranks": 2, "tokens_per_s": 4000.0, "seq": 256, "steps": 3, "gflops": 24.0,
                                   "mfu": 0.25}},
            "trl": {"status": "ok", "step_s": 8.0, "step_s_median": 8.0, "reward_first": 0.2, "reward_last": 0.25},
            "heldout": {"prompts": 200, "before": 0.3, "raygrpo_after": 0.35, "trl_after": 0.33}}


def test_table_rows_ratios():
    rows = {(part, measure): value for part, measure, value, _ in table.table_rows(_fake_results())}
    assert rows[("1 rollout", "Ray actor / direct")] == 0.8
    assert rows[("2 sync", "full update / raw broadcast")] == pytest.approx(4.0)
    assert rows[("2 sync", "full update (ZeRO-2) MB/s")] == pytest.approx(4 * 2**20 / 0.2 / 1e6)
    assert rows[("2 sync", "sync share of a step")] == 0.05
    assert rows[("3 schedule", "async / sync step time")] == pytest.approx(0.75)
    assert rows[("5 vs TRL", "raygrpo / TRL step time")] == pytest.approx(0.5)
    assert rows[("4 learner", "ZeRO-3 (2 rank(s))")] == 4000.0
    assert "MFU 25.0%" in table.format_table(table.table_rows(_fake_results()))
    assert rows[("5 vs TRL", "held-out accuracy, raygrpo")] == 0.35
    assert rows[("5 vs TRL", "held-out accuracy, TRL")] == 0.33


def test_table_rows_with_parts_missing_or_skipped():
    res = {"model": {"parameters": 10}, "trl": {"status": "skipped", "message": "--skip-trl"}}
    rows = table.table_rows(res)
    assert rows[-1][0] == "5 vs TRL" and rows[-1][2] is None and "skipped: --skip-trl" in rows[-1][3]
    assert table.format_table(rows)  # renders with n/a


def test_write_json_turns_nan_into_null(tmp_path):
    path = report.write_json(tmp_path / "a" / "bench.json", {"x": float("nan"), "y": [1.5, float("inf")], "t": (1, 2)})
    assert json.loads(path.read_text()) == {"x": None, "y": [1.5, None], "t": [1, 2]}
    assert not list(path.parent.glob("*.tmp"))


def test_machine_info_and_load_average():
    info = report.machine_info()
    assert info["cpu_count"] >= 1 and "torch" in info["versions"] and info["date"]
    la = report.load_average()
    assert la is None or (len(la) == 3 and all(math.isfinite(x) for x in la))


def test_model_spec_sizes():
    s = report.model_spec(256, 8)
    assert (s.hidden_size // s.num_heads, s.num_heads % s.num_kv_heads, s.intermediate_size) == (32, 0, 1024)
    assert report.model_spec(128, 4).num_heads == 4  # the demo's shape


def test_trl_settings_mirror_our_config():
    cfg = load_config(None, [*report.BENCH_SETTINGS, "model.path=/x", "trainer.steps=7"], validate_paths=False)
    s = trl.trl_settings(cfg, "/x", threads=2)
    t = cfg.trainer
    assert s["steps"] == 7 and s["group_size"] == t.group_size and s["prompts_per_step"] == t.prompts_per_step
    assert s["micro_batch_size"] * s["grad_accum"] == t.prompts_per_step * t.group_size
    assert s["micro_batch_size"] % t.group_size == 0
    assert (s["lr"], s["beta"], s["clip_high"], s["max_new_tokens"]) == (
        cfg.learner.lr, cfg.algo.beta, cfg.algo.clip_high, cfg.rollout.max_new_tokens)


def test_bench_cli_arguments():
    args = build_parser().parse_args(["bench", "--hidden-size", "256", "--num-layers", "8", "--skip-trl",
                                      "algo.beta=0"])
    assert (args.hidden_size, args.num_layers, args.skip_trl, args.overrides) == (256, 8, True, ["algo.beta=0"])
    assert args.out == "runs/bench/bench.json" and args.steps is None  # report.DEFAULT_STEPS, or MODEL_STEPS
    assert (report.DEFAULT_STEPS, report.DEFAULT_TRL_THREADS) == (5, "1,0")


def test_subprocess_entry_point_usage(capsys):
    assert bench.main([]) == 2
    assert "raygrpo bench" in capsys.readouterr().err


def test_parse_threads():
    assert trl.parse_threads("1") == [1]
    assert trl.parse_threads("1,2") == [1, 2]
    assert trl.parse_threads("0") == [os.cpu_count() or 1]
    assert trl.parse_threads("1,0") == sorted({1, os.cpu_count() or 1})  # no duplicate run on 1 CPU
    assert trl.parse_threads("") == [1]


def test_table_lists_extra_trl_thread_runs():
    res = _fake_results()
    res["trl"]["torch_threads"] = 1
    res["trl_2threads"] = {"status": "ok", "step_s_median": 16.0, "torch_threads": 2}
    measures = [m for _, m, _, _ in table.table_rows(res)]
    assert "TRL s/step (1 thread, median)" in measures and "TRL s/step (2 threads, median)" in measures


def test_bench_settings_are_a_valid_config_without_dynamic_sampling():
    cfg = load_config(None, [*report.BENCH_SETTINGS, "model.path=/x"], validate_paths=False)
    assert not cfg.trainer.dynamic_sampling and cfg.learner.mu == 1 and cfg.trainer.mode == "sync"


def test_renice_to_runs_a_subprocess_at_the_given_niceness():
    assert rollout.renice_to(None) is None
    want = min(19, rollout.current_niceness() + 3)
    out = subprocess.run([sys.executable, "-c", "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"],
                         capture_output=True, text=True, preexec_fn=rollout.renice_to(want), check=True)
    assert int(out.stdout) == want


def test_a_failing_part_leaves_partial_json(tmp_path, monkeypatch):
    def boom(args, res):
        res["machine"] = {"cpu_count": 2}
        raise RuntimeError("part 3 broke")

    monkeypatch.setattr(command, "_run_bench", boom)
    out = tmp_path / "b.json"
    with pytest.raises(RuntimeError):
        bench.run_bench(build_parser().parse_args(["bench", "--out", str(out)]))
    saved = json.loads(out.read_text())
    assert saved["error"] == "RuntimeError: part 3 broke" and saved["machine"] == {"cpu_count": 2}


def test_lora_rows():
    v = lambda b, s, o, t: {"bytes": b, "seconds": s, "optimizer_state_bytes": o, "trainable_params": t,  # noqa: E731
                            "total_params": 1000}
    res = {"lora": {"lora_rank": 16, "full": v(4000, 0.2, 12000, 1000), "adapter": v(400, 0.02, 1200, 100),
                    "merged": v(4000, 0.25, 1200, 100)}}
    rows = {(r[0], r[1]): r for r in table.table_rows(res)}
    assert rows[("6 lora", "sync adapter seconds")][2] == 0.02 and "10.0% of full" in rows[("6 lora", "sync adapter seconds")][3]
    assert rows[("6 lora", "optimizer state LoRA / full")][2] == pytest.approx(0.1)
