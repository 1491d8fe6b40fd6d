"""`raygrpo bench --model`: its arguments, settings, prompts, TRL's phase timer, the memory sampler and the
phase table with its verdict (no Ray, no vLLM, no model)."""
import json
import subprocess
import time

import pytest
import torch

from actors.rewards.functions import exact_match
from cluster.bench import model_bench, report, schedule, trl
from cluster.cli import build_parser, main
from cluster.config import ConfigError, load_config
from cluster.paths import SMOLLM2_FIXTURE
from learner.config import LearnerConfig, ReferenceConfig


def test_bare_model_flag_means_the_smollm2_fixture_and_model_defaults_are_resolved_later():
    args = build_parser().parse_args(["bench", "--model"])
    assert args.model == str(SMOLLM2_FIXTURE)
    assert (args.steps, args.trl_threads) == (None, None)  # 3 and "0" with --model, 5 and "1,0" without
    args = build_parser().parse_args(["bench", "--model", "/m", "algo.beta=0", "--steps", "2"])
    assert (args.model, args.overrides, args.steps) == ("/m", ["algo.beta=0"], 2)
    assert build_parser().parse_args(["bench"]).model == ""  # the tiny bench, as before


def test_model_setting_runs_the_schedules_and_trl_on_a_default_micro_batch(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    s = report.resolve_setting("default", model=str(tmp_path))
    assert (s.name, s.parts) == ("model", report.MODEL_PARTS) == ("model", ("schedule", "trl"))
    assert report.resolve_setting("default", parts="schedule", model=str(tmp_path)).parts == ("schedule",)
    cfg = load_config(None, [*s.overrides, "model.path=/m", "data.train=/d.jsonl"], validate_paths=False)
    t, r = cfg.trainer, cfg.rollout
    assert (t.prompts_per_step, t.group_size, r.max_new_tokens, r.min_new_tokens) == (4, 4, 32, 32)
    assert r.max_model_len > r.max_new_tokens and cfg.data.num_eval == 0 and not t.halt_on_zero_variance
    # the micro-batches are the defaults a user's run has (the memory figure is for that one)
    assert cfg.learner.micro_batch_size == LearnerConfig().micro_batch_size
    assert cfg.reference.micro_batch_size == ReferenceConfig().micro_batch_size
    assert not any(o.startswith("learner.micro_batch_size") for o in report.MODEL_SETTINGS)
    # TRL gets the same batch in the same micro-batches and the same forced completion length
    st = trl.trl_settings(cfg, "/m", threads=2)
    assert st["micro_batch_size"] * st["grad_accum"] == 16 and st["micro_batch_size"] == cfg.learner.micro_batch_size
    assert (st["max_new_tokens"], st["min_new_tokens"], st["data"]["train"]) == (32, 32, "/d.jsonl")
    # learner.dtype=bfloat16: TRL trains in its bf16 mode too, so the ratio compares like with like
    assert st["bf16"] is False
    bf16 = load_config(None, [*s.overrides, "model.path=/m", "data.train=/d.jsonl", "learner.dtype=bfloat16"],
                       validate_paths=False)
    assert trl.trl_settings(bf16, "/m", threads=2)["bf16"] is True


def test_the_missing_fixture_is_not_an_error_but_a_missing_directory_is(tmp_path):
    assert report.resolve_setting("default", model=str(SMOLLM2_FIXTURE)).name == "model"  # built when missing
    with pytest.raises(ConfigError, match="no such directory") as e:
        report.resolve_setting("default", model=str(tmp_path / "nope"))
    assert "override" not in str(e.value)
    with pytest.raises(ConfigError, match="overrides go before --model"):
        report.resolve_setting("default", model="algo.beta=0")
    with pytest.raises(ConfigError, match="no config.json"):
        report.resolve_setting("default", model=str(tmp_path))


def test_model_refuses_the_tiny_model_flags_and_the_long_setting(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="--hidden-size, --num-layers describe the tiny model"):
        report.resolve_setting("default", hidden_size=256, num_layers=4, model=str(tmp_path))
    with pytest.raises(ConfigError, match="--warm-start-steps describe"):
        report.resolve_setting("default", warm_start_steps=0, model=str(tmp_path))
    with pytest.raises(ConfigError, match="give --model or --setting long, not both"):
        report.resolve_setting("long", model=str(tmp_path))


def test_cli_exits_2_naming_a_bad_model_path_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "b.json"
    assert main(["bench", "--model", str(tmp_path / "nope"), "--out", str(out)]) == 2
    assert f"--model {tmp_path / 'nope'}: no such directory" in capsys.readouterr().err
    assert not out.exists()


def test_prompts_are_chat_rows_whose_numeric_answer_exact_match_scores(tmp_path):
    path = model_bench.write_prompts(tmp_path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == model_bench.DATA_ROWS
    assert [m["role"] for m in rows[0]["prompt"]] == ["system", "user"]
    assert all(r["answer"].isdigit() for r in rows)
    a = rows[0]["answer"]
    assert exact_match(rows[0]["prompt"], f"So the answer is\n#### {a}", answer=a) == 1.0
    assert exact_match(rows[0]["prompt"], f"#### {int(a) + 1}", answer=a) == 0.0
    assert model_bench.write_prompts(tmp_path).read_text() == path.read_text()  # the same file every run


class FakeTrainer:
    """The four GRPOTrainer methods the phase timer wraps, each taking a known time on a fake clock."""

    def __init__(self):
        self.ref_model, self.now = object(), 0.0

    def clock(self):
        return self.now

    def _generate(self, prompts):
        self.now += 20.0

    def _calculate_rewards(self, *a):
        self.now += 1.0

    def _get_per_token_logps_and_entropies(self, model, *a, **kw):
        self.now += 3.0 if model is self.ref_model else 100.0

    def _generate_and_score_completions(self, batch):
        self.now += 0.5
        self._generate(batch)
        self._calculate_rewards()
        self._get_per_token_logps_and_entropies(self, batch)  # the policy's own: not the reference
        self._get_per_token_logps_and_entropies(self.ref_model, batch)
        return {"prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]), "completion_mask": torch.tensor([[1, 1], [1, 0]])}


def test_trl_phase_timer_splits_a_step_into_generation_rewards_reference_and_training():
    trainer = FakeTrainer()
    phases = trl.PhaseTimer(clock=trainer.clock)
    phases.attach(trainer)
    trainer._generate_and_score_completions(["p"])
    phases.end_step(200.0)
    s = phases.steps
    assert (s["gen_s"], s["reward_s"], s["ref_s"], s["score_s"]) == ([20.0], [1.0], [3.0], [124.5])
    assert s["train_s"] == [75.5] and s["step_s"] == [200.0]  # the step's time outside generate-and-score
    assert (s["gen_tokens"], s["train_tokens"]) == ([3.0], [8.0])  # padding left out
    phases.end_step(0.5)  # a step without generation: zeros, not the last step's numbers
    assert s["gen_s"][1] == 0.0 and s["train_s"][1] == 0.5


def test_memory_sampler_finds_a_learner_process_by_its_ray_title(tmp_path):
    proc = subprocess.Popen(["bash", "-c", "exec -a ray::LearnerWorker.train sleep 30"])
    try:
        for _ in range(50):  # until the exec has replaced bash
            if model_bench.ray_processes().get(str(proc.pid)) == "LearnerWorker":
                break
            time.sleep(0.05)
        sampler = model_bench.MemorySampler(tmp_path / "metrics.jsonl", steps=1)
        sampler.sample()
    finally:
        proc.kill()
        proc.wait()
    mem = sampler.result(micro_batch=8, reference_on_learner=True)
    assert mem["learner_peak_rss_mb"] is not None and mem["peak_rss_mb_by_actor"]["LearnerWorker"] >= 0
    assert mem["learner_vmhwm_mb"] >= mem["learner_peak_rss_mb"] and mem["micro_batch_size"] == 8
    assert "learner.micro_batch_size=8, the reference model on the learner too" in model_bench.memory_line(mem)
    assert "n/a" in model_bench.memory_line({"learner_peak_rss_mb": None})


def test_memory_sampler_stops_when_the_last_training_step_is_logged(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"kind": "eval"}) + "\n" + json.dumps({"step": 1}) + "\n")
    with model_bench.MemorySampler(metrics, steps=2, every_s=0.01) as sampler:
        # a sample walks the process table: on a loaded machine one took longer than the 0.1 s this waited
        deadline = time.time() + 30
        while sampler.samples < 2 and time.time() < deadline:
            time.sleep(0.01)
        assert sampler._thread.is_alive() and sampler.samples >= 2  # one training row of two: still sampling
        with open(metrics, "a") as f:
            f.write(json.dumps({"kind": "train", "step": 2}) + "\n")
        sampler._thread.join(5)
        assert not sampler._thread.is_alive() and sampler.samples >= 2


def _rows(*steps):
    return [{"kind": "train", "step": i, "step_s": st, "gen_s": g, "reward_s": 0.1, "ref_s": ref, "train_s": tr,
             "sync_s": sy, "gen_tokens": 512, "perf/train_tokens_per_s": tps}
            for i, (st, g, ref, tr, sy, tps) in enumerate(steps, 1)]


def _results():
    warm = (200.0, 100.0, 0.0, 90.0, 10.0, 1.0)
    sync = {"step_s_median": 60.0, "gen_tokens_per_s": 25.6, "reference_on_learner": True,
            "rows": _rows(warm, (60.0, 20.0, 5.0, 30.0, 2.0, 40.0), (60.0, 20.0, 7.0, 30.0, 2.0, 60.0))}
    asy = {"step_s_median": 40.0, "gen_tokens_per_s": 20.0, "reference_on_learner": False,
           "gen_side_s": 26.0, "learner_side_s": 35.0,
           "rows": _rows(warm, (40.0, 20.0, 6.0, 33.0, 2.0, 40.0), (40.0, 20.0, 6.0, 33.0, 2.0, 40.0))}
    trl_res = {"status": "ok", "torch_threads": 2, "step_s_median": 100.0,
               "phases": {"step_s": [300.0, 100.0, 100.0], "gen_s": [200.0, 60.0, 60.0], "reward_s": [0.0, 0.1, 0.1],
                          "ref_s": [9.0, 5.0, 5.0], "train_s": [90.0, 30.0, 34.0], "score_s": [210.0, 66.0, 66.0],
                          "gen_tokens": [512, 512, 512], "train_tokens": [1500, 1500, 1500]}}
    return {"schedules": {"sync": sync, "async": asy}, "trl": trl_res,
            "trl_1threads": {"status": "failed"}, "memory": {"learner_peak_rss_mb": 5000, "micro_batch_size": 8}}


def test_phase_rows_leave_the_warm_up_out_and_name_the_bounding_phase():
    rows = {r["run"]: r for r in model_bench.phase_rows(_results())}
    assert set(rows) == {"raygrpo sync", "raygrpo async", "TRL (2 thread(s))"}  # the failed TRL run left out
    s = rows["raygrpo sync"]
    assert (s["step_s"], s["gen_s"], s["ref_s"], s["train_s"], s["sync_s"]) == (60.0, 20.0, 6.0, 30.0, 2.0)
    assert s["train_tokens_per_s"] == 50.0 and s["bound"] == "train_s"
    assert rows["raygrpo async"]["bound"] == "train_s"  # the learner side (35 s) is the longer one
    t = rows["TRL (2 thread(s))"]
    assert (t["gen_s"], t["ref_s"], t["train_s"], t["sync_s"]) == (60.0, 5.0, 32.0, 0.0)
    assert t["gen_tokens_per_s"] == pytest.approx(1024 / 120) and t["train_tokens_per_s"] == pytest.approx(3000 / 64)
    assert t["bound"] == "gen_s"


def test_async_bound_is_the_longest_phase_of_the_longer_side():
    res = _results()
    a = res["schedules"]["async"]
    a["gen_side_s"], a["learner_side_s"] = 40.0, 10.0
    for r in a["rows"]:
        r["ref_s"] = 25.0  # the reference actor runs while the batch is collected: on the generation side
    (row,) = [r for r in model_bench.phase_rows(res) if r["run"] == "raygrpo async"]
    assert row["bound"] == "ref_s"
    a["reference_on_learner"] = True  # then it is the learner's: the generation side's longest is generation
    (row,) = [r for r in model_bench.phase_rows(res) if r["run"] == "raygrpo async"]
    assert row["bound"] == "gen_s"


def test_verdict_compares_the_best_of_each_side_against_the_goal():
    rows = model_bench.phase_rows(_results())
    v = model_bench.verdict(rows)
    assert (v["ratio"], v["raygrpo"], v["trl"], v["bound"], v["met"]) == (0.4, "raygrpo async", "TRL (2 thread(s))",
                                                                          "train_s", True)
    assert v["line"].startswith("raygrpo-best / TRL-best step time: 0.40x (raygrpo async 40.0 s vs TRL (2 thread(s)) "
                                "100.0 s; goal <= 0.5x: met); bounded by training (33.0 s, 82% of the step)")
    res = _results()
    res["trl"]["step_s_median"] = 50.0
    assert "goal <= 0.5x: not met" in model_bench.verdict(model_bench.phase_rows(res))["line"]
    assert model_bench.verdict(rows[:2])["ratio"] is None  # no TRL run: n/a, no crash


def test_report_lines_print_an_aligned_phase_table_the_verdict_and_the_memory():
    lines = "\n".join(model_bench.report_lines(_results())).splitlines()
    table = [line for line in lines if line.startswith("|")]
    assert len(table) == 5 and len({len(line) for line in table}) == 1  # header, rule, 3 runs
    assert table[0].split("|")[1].strip() == "run" and "sync ms" in table[0] and "bound by" in table[0]
    assert table[2].startswith("| raygrpo sync ") and " 2000 | training " in table[2]  # sync 2 s in ms
    assert any(line.startswith("raygrpo-best / TRL-best") for line in lines)
    assert any("peak RSS 5,000 MB" in line for line in lines)
    assert model_bench.report_lines({}) == []


def test_a_failing_sync_run_still_leaves_its_memory_samples(tmp_path, monkeypatch, tiny_chat_model_dir):
    class Killed:  # the trainer of a run whose learner the node's memory monitor killed
        def __init__(self, cfg):
            pass

        def run(self):
            raise RuntimeError("learner rank 0 died")

    monkeypatch.setattr(schedule, "Trainer", Killed)
    monkeypatch.setattr(model_bench.MemorySampler, "sample", lambda self: self.peak_rss_kb.update(LearnerWorker=5 * 2**20)
                        or self.hwm_kb.update(LearnerWorker=5 * 2**20))
    memory = {}
    with pytest.raises(RuntimeError, match="died"):
        schedule.bench_schedule([*report.MODEL_SETTINGS, f"model.path={tiny_chat_model_dir}",
                                 f"data.train={model_bench.write_prompts(tmp_path)}"], "sync",
                                tmp_path / "run", memory)
    assert memory["learner_peak_rss_mb"] == 5120 and memory["micro_batch_size"] == LearnerConfig().micro_batch_size
    assert memory["reference_on_learner"] is True  # the sync schedule on CPU: the reference on the learner
