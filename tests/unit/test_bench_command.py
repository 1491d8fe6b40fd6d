"""`raygrpo bench`'s run of every part (cluster/bench/command.py _run_bench), with each measurement replaced by a
fake that returns a fixed result and Ray by a recorder: the parts run in their order, Ray is down before the
held-out accuracy and TRL, the JSON holds each part's result under its key, and the table is printed. What
each part measures is tested beside the part (test_bench.py, test_bench_model.py, ...)."""
from __future__ import annotations

import json
import sys
import types

import pytest

from cluster.bench import command, cross_host
from cluster.cli import build_parser


class Example:
    def __init__(self, i: int):
        self.prompt = f"{i} + {i} ="


def _install_fakes(monkeypatch, tiny_model_dir, calls: list) -> None:
    def call(name, result=None):
        def fake(*args, **kw):
            calls.append(name)
            return result() if callable(result) else result
        return fake

    ray = types.SimpleNamespace(remote=lambda **kw: lambda fn: types.SimpleNamespace(remote=lambda: "niceness"),
                                get=lambda ref, timeout: 15, kill=call("ray.kill"), shutdown=call("ray.shutdown"))
    monkeypatch.setitem(sys.modules, "ray", ray)
    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        staticmethod(lambda path: types.SimpleNamespace(pad_token_id=0)))
    monkeypatch.setattr(sys, "argv", ["raygrpo", "bench"])
    monkeypatch.setattr(command, "progress", lambda msg: calls.append(f"progress: {msg}"))
    monkeypatch.setattr(command, "load_average", lambda: [1.0, 1.0, 1.0])
    monkeypatch.setattr(command, "machine_info", lambda: {"cpu_count": 2, "cpu_model": "test CPU"})
    monkeypatch.setattr(command.time, "perf_counter", lambda: 0.0)
    monkeypatch.setattr(command, "build_tiny_model", call("build_tiny_model", tiny_model_dir))
    monkeypatch.setattr(command, "num_parameters", lambda path: 1_000_000)
    monkeypatch.setattr(command, "warm_start", call("warm_start", tiny_model_dir))
    monkeypatch.setattr(command, "load_splits", call("load_splits", ([Example(i) for i in range(8)], [])))
    monkeypatch.setattr(command, "start_ray", call("start_ray"))
    sync = {"seconds": 0.5, "bytes": 2**20, "backend": "gloo", "transport": "gloo"}
    monkeypatch.setattr(cross_host, "bench_cross_host", call("crosshost", {
        "sync": sync, "raw_broadcast": {"seconds": 0.25}, "vs_raw": 2.0, "host_a": "a", "host_b": "b"}))
    rollout = {"prompts": 8, "group_size": 4, "max_new_tokens": 8, "threads": 1, "same_tokens": True,
               "actor_vs_direct": 0.9, "direct": {"tokens_per_s": 100.0}, "wrapper": {"tokens_per_s": 95.0},
               "actor": {"tokens_per_s": 90.0, "tokens_per_call": 64}}
    monkeypatch.setattr(command, "bench_rollout", call("rollout", (rollout, "engine", ["rollouts"])))
    monkeypatch.setattr(command, "fixed_batch", lambda rollouts, pad, with_ref: list(range(6)))
    monkeypatch.setattr(command, "bench_learner_and_sync", call("learner_and_sync", (
        {"ranks": 2, "tokens_per_s": 50.0, "seq": 6, "steps": 3, "gflops": 1.0}, sync)))
    monkeypatch.setattr(command, "bench_lora", call("lora", {"lora_rank": 16}))
    monkeypatch.setattr(command, "bench_raw_broadcast", call("raw_broadcast", {"seconds": 0.25, "bytes": 2**20}))
    schedule = {"step_s": 2.0, "step_s_median": 2.0, "hf_model": str(tiny_model_dir), "reward_first": 0.1,
                "reward_last": 0.2}
    monkeypatch.setattr(command, "bench_schedule", call("schedule", lambda: (dict(schedule), [{"step": 1}])))
    monkeypatch.setattr(command.reward_part, "run_part", call("rewards"))
    monkeypatch.setattr(command.pipeline_part, "run_part", call("pipeline", {"modes": {}}))
    monkeypatch.setattr(command.code_part, "run_part", call("code"))
    monkeypatch.setattr(command, "heldout_examples", lambda data, seed: [1, 2])
    monkeypatch.setattr(command, "heldout_accuracy", call("heldout", 0.5))
    monkeypatch.setattr(command, "bench_trl", call("trl", {"status": "ok", "step_s": 4.0, "step_s_median": 4.0,
                                                            "torch_threads": 1, "heldout_accuracy_after": 0.4}))


@pytest.fixture
def bench_run(monkeypatch, tmp_path, tiny_model_dir, capsys):
    calls: list = []
    _install_fakes(monkeypatch, tiny_model_dir, calls)
    out = tmp_path / "bench" / "bench.json"
    args = build_parser().parse_args(["bench", "--out", str(out), "--cache-dir", str(tmp_path / "cache"),
                                      "--parts", "rollout,learner,sync,schedule,trl,lora,rewards,pipeline,code,crosshost",
                                      "--trl-threads", "1"])
    assert command._run_bench(args, {}) == 0
    return calls, out.read_text(), capsys.readouterr().out


def test_every_part_runs_in_order_and_ray_is_down_before_heldout_and_trl(bench_run):
    calls, _, _ = bench_run
    measured = [c for c in calls if not c.startswith("progress")]
    assert measured == ["build_tiny_model", "load_splits", "warm_start", "start_ray", "crosshost", "load_splits",
                        "rollout", "learner_and_sync", "learner_and_sync", "lora", "ray.kill", "raw_broadcast",
                        "schedule", "schedule", "load_splits", "rewards", "pipeline", "code", "ray.shutdown",
                        "heldout", "heldout", "trl"]


def test_the_json_holds_each_part_under_its_key_and_the_table(bench_run):
    _, text, _ = bench_run
    res = json.loads(text)
    assert list(res) == ["machine", "load_average_start", "command", "setting", "model", "config",
                         "ray_worker_niceness", "driver_niceness", "cross_host", "rollout", "learner", "sync",
                         "sync_zero3", "lora", "raw_broadcast", "schedules", "pipeline", "heldout", "trl",
                         "load_average_end", "wall_seconds", "table", "phases", "verdict"]
    assert list(res["learner"]) == ["ZeRO-2", "ZeRO-3"] and res["sync"]["vs_raw"] == 2.0
    assert list(res["schedules"]) == ["sync", "async"] and res["heldout"] == {
        "prompts": 2, "before": 0.5, "raygrpo_after": 0.5, "trl_after": 0.4}
    measures = [row[1] for row in res["table"]]
    assert measures[0] == "parameters" and "full update / raw broadcast" in measures
    assert res["table"][-1][0] == "crosshost"


def test_the_printed_report_has_the_summary_line_and_the_table(bench_run):
    _, text, printed = bench_run
    assert "raygrpo bench: 1,000,000 parameters, 2 CPUs (test CPU), load average [1.0, 1.0, 1.0]" in printed
    tables = [[line for line in block.splitlines() if line.startswith("|")] for block in printed.split("\n\n")]
    tables = [t for t in tables if t]
    main, phases = tables  # the bench's table, then the per-phase table of the schedules and TRL
    assert main[0].split("|")[1].strip() == "part" and len(main) == len(json.loads(text)["table"]) + 2
    assert phases[0].split("|")[1].strip() == "run" and len(phases) == 2 + 3  # raygrpo sync, async, TRL
    assert printed.rstrip().endswith("bench.json")
