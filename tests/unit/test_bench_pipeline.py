"""`raygrpo bench --parts pipeline`: the part's arithmetic on fake metrics rows (pipeline_summary.py), the
part's name, and the long-tailed model it trains (cluster/models/longtail.py)."""
import pytest
import torch

from cluster.bench import pipeline_summary as ps
from cluster.bench.report import model_spec, resolve_setting
from cluster.config import ConfigError
from cluster.models.longtail import PROBE_PROMPTS, build_longtail_model


def _row(step, gen_s, step_s, tokens, train_s=1.0, sync_s=0.5, reward_s=0.1, ref_s=0.2, pause_s=None, busy=None):
    r = {"kind": "train", "step": step, "gen_s": gen_s, "step_s": step_s, "gen_tokens": tokens, "train_s": train_s,
         "sync_s": sync_s, "reward_s": reward_s, "ref_s": ref_s, "sync_verified": True, "weight_version": step}
    if pause_s is not None:  # a pipeline row: the engine's busy share of its own interval between two batches
        r["pipeline/pause_s"], r["pipeline/engine_busy_frac"] = pause_s, busy if busy is not None else gen_s / step_s
    return r


WARMUP = _row(1, 50.0, 100.0, 10)  # left out of every figure

RUNS = {
    # sync: 2 s generating of 4 s steps, 1000 tokens a step
    "sync": [WARMUP, _row(2, 2.0, 4.0, 1000), _row(3, 2.0, 4.0, 1000)],
    # async: 2 s generating of 3 s steps
    "async": [WARMUP, _row(2, 2.0, 3.0, 1000), _row(3, 2.0, 3.0, 1000)],
    # pipeline: 1.95 s of 2 s steps, 1000 tokens: 1.5x async's tokens/s, idle 2.5%
    "pipeline": [WARMUP, _row(2, 1.95, 2.0, 1000, pause_s=0.05), _row(3, 1.95, 2.0, 1000, pause_s=0.05)],
}
THREADS = {"rollout-0": 1, "learner-0": 1, "reference": 2}


TRAINED = {1: 5, 2: 900, 3: 900}  # step -> completion tokens trained on (completions.jsonl)


def _modes(runs=RUNS):
    return {m: ps.mode_summary(m, rows, ref_actor=True, threads=THREADS, trained_tokens=TRAINED) for m, rows in runs.items()}


def test_mode_summary_one_definition_for_every_mode():
    s = _modes()
    assert s["sync"]["steps_measured"] == 2
    assert s["sync"]["tokens_per_s"] == pytest.approx(2000 / 8)
    assert s["sync"]["engine_idle_frac"] == pytest.approx(0.5)
    assert s["async"]["engine_idle_frac"] == pytest.approx(1 - 4 / 6)
    assert s["pipeline"]["engine_idle_frac"] == pytest.approx(0.025)
    assert s["pipeline"]["tokens_per_s"] == pytest.approx(500.0)
    assert s["pipeline"]["engine_tokens_per_busy_s"] == pytest.approx(1000 / 1.95)
    assert s["async"]["step_s_median"] == pytest.approx(3.0)
    assert s["sync"]["sync_verified_every_step"] is True
    # 1 engine thread busy 97.5% + 1 learner thread busy (train 1 + sync 0.5) / 2 s = 75%
    assert s["pipeline"]["core_demand"] == pytest.approx(0.975 + 0.75)
    assert s["async"]["trained_tokens_per_s"] == pytest.approx(1800 / 6)


def test_pipeline_engine_window_is_its_own_interval_not_the_step():
    # the engine's interval runs from one batch to the next, so it holds the learner's previous step: a row's
    # gen_s can exceed its step_s; busy 6 s of an 8 s interval (75%), the step itself 4 s
    rows = [WARMUP, _row(2, 6.0, 4.0, 1200, pause_s=0.1, busy=0.75), _row(3, 3.0, 4.0, 600, pause_s=0.1, busy=0.5)]
    s = ps.mode_summary("pipeline", rows, ref_actor=True, trained_tokens={2: 1000, 3: 500})
    assert s["window_s"] == pytest.approx(8.0 + 6.0)
    assert s["engine_idle_frac"] == pytest.approx(1 - 9.0 / 14.0)
    assert s["tokens_per_s"] == pytest.approx(1800 / 14.0)
    assert s["trained_tokens_per_s"] == pytest.approx(1500 / 8.0)  # trained: per second of the steps
    # own devices: max(engine 6.1 + 3.1, learner 2 x 1.5) over the run
    assert s["predicted_step_s"] == pytest.approx(9.2 / 2)


def test_prediction_sums_sync_and_overlaps_async_and_pipeline():
    s = _modes()
    # sync: gen 2 + reward 0.1 + ref 0.2 + train 1 + sync 0.5
    assert s["sync"]["predicted_step_s"] == pytest.approx(3.8)
    # async: max(gen 2 + reward 0.1 + ref actor 0.2 + sync 0.5, train 1 + sync 0.5)
    assert s["async"]["predicted_step_s"] == pytest.approx(2.8)
    # pipeline: max(busy 1.95 + pause 0.05, learner 1.5); rewards and the reference off the engine's path
    assert s["pipeline"]["predicted_step_s"] == pytest.approx(2.0)
    assert s["pipeline"]["predicted_tokens_per_s"] == pytest.approx(500.0)
    assert s["pipeline"]["predicted_engine_idle_frac"] == pytest.approx(0.025)
    # the learner's side bounds it when it is the longer one
    slow = {"pipeline": [WARMUP, _row(2, 1.0, 3.0, 1000, train_s=2.5, pause_s=0.1)]}
    p = ps.mode_summary("pipeline", slow["pipeline"], ref_actor=False)
    assert p["predicted_step_s"] == pytest.approx(2.5 + 0.5 + 0.2)  # train + sync + the reference on the learner


def test_verdict_met_and_missed_by_how_much():
    v = ps.verdict(_modes())
    assert v["idle_met"] and v["speedup_met"]
    assert v["pipeline_vs_async_tokens"] == pytest.approx(1.5)
    assert "met" in v["line"] and "missed" not in v["line"]
    slow = dict(RUNS, pipeline=[WARMUP, _row(2, 2.2, 2.75, 1000, pause_s=0.1)])  # 1.09x async, idle 20%
    v = ps.verdict(_modes(slow))
    assert not v["idle_met"] and not v["speedup_met"]
    assert "missed by 15.0 points" in v["line"]
    assert "1.09x" in v["line"] and "missed by 0.21x" in v["line"]
    assert v["pipeline_vs_async_trained_tokens"] == pytest.approx((900 / 2.75) / (1800 / 6))
    assert ps.verdict({})["line"].count("n/a") == 2


def test_length_quantiles_and_the_cap():
    q = ps.length_quantiles(list(range(1, 101)) + [128, 128], cap=128)
    assert (q["n"], q["p50"], q["p90"], q["max"]) == (102, 51, 92, 128)
    assert q["capped_frac"] == pytest.approx(2 / 102)
    assert ps.length_quantiles([], 128) == {"n": 0}


def test_table_rows_and_lines():
    modes = _modes()
    modes["pipeline"]["lengths"] = ps.length_quantiles([3, 10, 128], 128)
    part = {"workload": {"steps": 3, "prompts_per_step": 16, "group_size": 8, "max_new_tokens": 128},
            "modes": modes, "verdict": ps.verdict(modes)}
    rows = ps.table_rows({"pipeline": part})
    measures = [r[1] for r in rows]
    for mode in ps.MODES:
        assert f"{mode}: generated tokens/s" in measures and f"{mode}: engine idle fraction" in measures
    assert dict((r[1], r[2]) for r in rows)["pipeline / async generated tokens/s"] == pytest.approx(1.5)
    lines = ps.report_lines(part)
    assert any(line.startswith("lengths (pipeline, 3 completions)") for line in lines)
    assert any(line.startswith("verdict: ") for line in lines)
    assert any(line.startswith("prediction (") and "pipeline / async 1.40x" in line for line in lines)  # 500 / (2000 / 5.6)
    assert ps.table_rows({}) == []


def test_pipeline_is_a_named_only_part():
    assert "pipeline" not in resolve_setting("default").parts
    assert resolve_setting("default", parts="pipeline").parts == ("pipeline",)
    with pytest.raises(ConfigError, match="leave --model out"):
        resolve_setting("default", parts="pipeline", model="/nonexistent")


def test_longtail_model_raises_only_the_eos_logit(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = model_spec(64, 1)
    out = build_longtail_model(tmp_path / "lt", tmp_path / "base", spec, 3.0)
    assert build_longtail_model(tmp_path / "lt", tmp_path / "base", spec, 3.0) == out  # cached
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
    lt = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert not lt.config.tie_word_embeddings
    changed = (lt.lm_head.weight - base.lm_head.weight).abs().sum(1).nonzero().flatten().tolist()
    tok = AutoTokenizer.from_pretrained(str(out))
    assert changed == [tok.eos_token_id]
    with torch.no_grad():
        logits = lt(tok(list(PROBE_PROMPTS), return_tensors="pt").input_ids).logits
    others = torch.cat([logits[..., :tok.eos_token_id], logits[..., tok.eos_token_id + 1:]], dim=-1)
    assert logits[..., tok.eos_token_id].mean() > 1.0 + others.mean()  # raised against every other token
