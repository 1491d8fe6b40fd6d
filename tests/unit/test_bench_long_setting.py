"""`raygrpo bench --setting long` and `rollout.min_new_tokens`: resolution and validation (no runs)."""
import pytest
import torch

from actors.config import RolloutConfig
from cluster.bench import report, table, trl
from cluster.cli import build_parser
from cluster.config import ConfigError, load_config
from cluster.models.tinymodel import _padded_vocab, build_tokenizer


def test_min_new_tokens_is_validated():
    assert RolloutConfig().min_new_tokens == 0 and RolloutConfig().problems() == []
    assert RolloutConfig(max_new_tokens=16, min_new_tokens=16).problems() == []
    for bad in (-1, 17):
        (problem,) = RolloutConfig(max_new_tokens=16, min_new_tokens=bad).problems()
        assert "rollout.min_new_tokens" in problem and "16" in problem
    (problem,) = RolloutConfig(env="calculator", max_model_len=256, min_new_tokens=4).problems()
    assert "single-turn" in problem and "min_new_tokens=0" in problem


def test_min_new_tokens_above_max_new_tokens_fails_at_load():
    with pytest.raises(ConfigError, match="rollout.min_new_tokens"):
        load_config(None, ["model.path=/x", "rollout.max_new_tokens=8", "rollout.min_new_tokens=9"],
                    validate_paths=False)


def test_default_setting_is_todays_bench():
    s = report.resolve_setting("default")
    assert (s.hidden_size, s.num_layers, s.warm_start_steps) == (128, 4, 900)
    assert s.parts == report.ALL_PARTS and list(s.overrides) == report.BENCH_SETTINGS
    s = report.resolve_setting("default", 256, 8, 0, "schedule,trl")
    assert (s.hidden_size, s.num_layers, s.warm_start_steps, s.parts) == (256, 8, 0, ("schedule", "trl"))
    assert s.describe()["setting_overrides"] == []


def test_long_setting_resolves_to_the_pinned_overrides():
    s = report.resolve_setting("long")
    assert (s.name, s.hidden_size, s.num_layers) == ("long", report.LONG_MODEL["hidden_size"],
                                                     report.LONG_MODEL["num_layers"])
    assert s.warm_start_steps == 0 and s.parts == report.LONG_PARTS == ("schedule", "trl")
    assert list(s.overrides) == [*report.BENCH_SETTINGS, *report.LONG_SETTINGS]  # the long ones win
    assert s.describe()["setting_overrides"] == report.LONG_SETTINGS
    cfg = load_config(None, [*s.overrides, "model.path=/x"], validate_paths=False)
    r = cfg.rollout
    assert r.max_new_tokens >= 128 and r.min_new_tokens == r.max_new_tokens  # no completion stops early
    assert r.max_model_len > r.max_new_tokens and cfg.data.num_eval == 0
    assert not cfg.trainer.halt_on_zero_variance  # a random model's rewards are all equal
    assert not cfg.trainer.dynamic_sampling and cfg.learner.mu == 1
    assert report.resolve_setting("long", parts="rollout").parts == ("rollout",)


def test_long_setting_refuses_a_warm_start_and_unknown_parts():
    with pytest.raises(ConfigError, match="random weights"):
        report.resolve_setting("long", warm_start_steps=900)
    assert report.resolve_setting("long", warm_start_steps=0).warm_start_steps == 0
    with pytest.raises(ConfigError, match="unknown part"):
        report.resolve_setting("default", parts="schedule,bogus")
    with pytest.raises(ConfigError, match="--setting"):
        report.resolve_setting("huge")


def test_long_model_has_at_least_30m_parameters():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    spec = report.model_spec(report.LONG_MODEL["hidden_size"], report.LONG_MODEL["num_layers"])
    config = Qwen2Config(vocab_size=_padded_vocab(len(build_tokenizer())), hidden_size=spec.hidden_size,
                         intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
                         num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                         tie_word_embeddings=spec.tie_word_embeddings)
    with torch.device("meta"):  # shapes only, no weights
        model = Qwen2ForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) >= 30_000_000  # parameters() counts tied ones once


def test_cli_setting_flag():
    args = build_parser().parse_args(["bench", "--setting", "long", "--steps", "2"])
    assert (args.setting, args.hidden_size, args.num_layers, args.warm_start_steps, args.parts) == (
        "long", None, None, None, "")
    assert build_parser().parse_args(["bench"]).setting == "default"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--setting", "huge"])


def test_trl_gets_the_same_min_new_tokens():
    cfg = load_config(None, [*report.resolve_setting("long").overrides, "model.path=/x", "trainer.steps=2"],
                      validate_paths=False)
    s = trl.trl_settings(cfg, "/x", threads=1)
    assert s["min_new_tokens"] == s["max_new_tokens"] == cfg.rollout.max_new_tokens
    n_seq = cfg.trainer.prompts_per_step * cfg.trainer.group_size
    assert s["micro_batch_size"] * s["grad_accum"] == n_seq and s["micro_batch_size"] % cfg.trainer.group_size == 0


def test_table_shows_async_against_trl():
    res = {"setting": {"name": "long"}, "model": {"parameters": 31_000_000, "hidden_size": 512, "num_layers": 8},
           "schedules": {"sync": {"step_s_median": 10.0}, "async": {"step_s_median": 6.0}},
           "trl": {"status": "ok", "step_s_median": 20.0, "torch_threads": 1},
           "trl_2threads": {"status": "ok", "step_s_median": 12.0, "torch_threads": 2}}
    rows = {m: v for _, m, v, _ in table.table_rows(res)}
    assert rows["raygrpo / TRL step time"] == 0.5 and rows["raygrpo async / TRL (1 thread)"] == 0.3
    assert rows["raygrpo async / TRL (2 threads)"] == 0.5 and rows["raygrpo sync / TRL (2 threads)"] == 10 / 12
    assert rows["best raygrpo / best TRL"] == 0.5  # async 6.0 vs TRL with 2 threads 12.0
    res["schedules"]["async"]["step_s_median"] = 30.0  # now sync is the faster schedule, TRL 2 threads still
    assert {m: v for _, m, v, _ in table.table_rows(res)}["best raygrpo / best TRL"] == 10 / 12
    assert "random weights" in table.table_rows(res)[0][3]
