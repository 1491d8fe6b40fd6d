"""A chat model on conversational data through the whole system: real Ray, vLLM, DeepSpeed, and the
offline BPE chat model (ChatML template, EOS <|im_end|>).

One short run (each run costs an engine and a learner start): the conversational JSONL trains (a TRL-style and
a per-sample reward function beside gsm8k, and one overlong row that must be filtered), the same rows as parquet
are its evaluation set, and the model is the variant that has no pad token (the driver pads with its EOS, which
also ends every completion: what it trains on is checked token by token).
"""
from __future__ import annotations

import json

import datasets  # noqa: TID253 - the test writes parquet and save_to_disk data with it
import pytest

from cluster.config import load_config
from cluster.data.dataset import load_examples
from cluster.driver.trainer import Trainer
from cluster.models.wordproblems import conversational_rows, write_jsonl
from cluster.run.metrics import read_metrics

LONG_ROW = {"prompt": [{"role": "user", "content": "How many apples? " * 40}], "answer": "#### 1"}

REWARD_CODE = '''
def length_trl(prompts, completions, answer, **kwargs):
    assert all(isinstance(p, list) for p in prompts) and all(c[0]["role"] == "assistant" for c in completions)
    return [len(c[0]["content"]) / 100 for c in completions]

def length_per_sample(prompt, completion, answer):
    return len(completion) / 100
'''


def chat_config(model_dir, run_dir, train, *overrides):
    return load_config(None, [
        f"model.path={model_dir}", f"trainer.run_dir={run_dir}", f"data.train={train}", "trainer.steps=3",
        "trainer.prompts_per_step=4", "trainer.group_size=4", "data.num_eval=0", "rollout.max_model_len=96",
        "rollout.max_new_tokens=16", "learner.lr=1e-3", "learner.micro_batch_size=16", "metrics.tensorboard=false",
        "trainer.actor_timeout_s=600", "reward.functions=[gsm8k]", *overrides])


def capture_batches(trainer: Trainer) -> list:
    """Every batch the driver trains on (it holds the prompt ids vLLM reported it saw)."""
    learn, seen = trainer._learn, []

    def learn_and_record(batch, sw):
        seen.append(batch)
        return learn(batch, sw)

    trainer._learn = learn_and_record
    return seen


def capture_scores(trainer: Trainer) -> list:
    score, seen = trainer.scorer.score, []

    def score_and_record(*args, **kwargs):
        seen.append(score(*args, **kwargs))
        return seen[-1]

    trainer.scorer.score = score_and_record
    return seen


def test_conversational_jsonl_trains_with_gsm8k_on_a_model_without_pad_token_and_evaluates_the_rows_as_parquet(
        tiny_chat_nopad_model_dir, ray_cluster, tmp_path, capsys):
    """The JSONL trains; the same rows written as parquet (what `datasets` writes) load as the same examples and
    are the held-out set the run evaluates on, so the parquet reader runs in the run too. The model declares no
    pad token (as some base models ship): the batches are padded with its EOS, and every check below of the ids
    and lengths trained on is made on that model. (Formerly two runs: this one on the model with a pad token, and
    a parquet-trained run on this model.)"""
    from transformers import AutoTokenizer

    model = tiny_chat_nopad_model_dir
    tokenizer = AutoTokenizer.from_pretrained(model)
    assert tokenizer.pad_token is None and tokenizer.eos_token is not None
    rows = conversational_rows(12, seed=3)
    data = write_jsonl(tmp_path / "chat.jsonl", rows[:6] + [LONG_ROW] + rows[6:])
    parquet = tmp_path / "chat.parquet"
    datasets.Dataset.from_list(rows[:6] + [LONG_ROW] + rows[6:]).to_parquet(str(parquet))
    assert load_examples(str(parquet)) == load_examples(str(data))
    rewards = tmp_path / "length_rewards.py"
    rewards.write_text(REWARD_CODE)
    trl, per_sample = f"{rewards}:length_trl", f"{rewards}:length_per_sample"
    cfg = chat_config(model, tmp_path / "run", data, f"data.eval={parquet}", "data.num_eval=2",
                      "trainer.eval_pass_k=2", f"reward.functions=[gsm8k, '{trl}', '{per_sample}']",
                      "reward.weights=[1.0, 0.0, 0.0]")
    trainer = Trainer(cfg)
    batches, scores = capture_batches(trainer), capture_scores(trainer)
    summary = trainer.run()

    # no pad token: the driver pads with the EOS (cluster/driver/trainer.py _setup)
    assert trainer.pad_id == tokenizer.eos_token_id
    # the overlong row was filtered at load, counted and reported once (train and eval)
    out = capsys.readouterr().out
    assert out.count("filtered 1 of 13 train prompts longer than 80 tokens") == 1
    assert "filtered 1 of 13 eval prompts" in out
    steps = read_metrics(tmp_path / "run")
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["gen_tokens"] > 0 and r["loss"] is not None and r["skipped_prompts"] == 0 for r in steps)
    assert summary["before"]["num_prompts"] == 2 and summary["after"] is not None
    assert (tmp_path / "run" / "hf_model" / "config.json").exists()

    # the token ids vLLM reports it saw are apply_chat_template's ids of the row
    checked = 0
    for batch in batches:
        for g, example in enumerate(batch.examples):
            expected = tokenizer.apply_chat_template(example.prompt, add_generation_prompt=True, return_dict=True)
            assert batch.prompt_ids[g * cfg.trainer.group_size] == expected["input_ids"]
            assert example.prompt != LONG_ROW["prompt"]
            checked += 1
    assert checked == 12  # 3 steps x 4 prompts

    # a TRL-style function and a per-sample one agree on every real completion
    assert len(scores) == 3
    values = [v for s in scores for v in s.per_function[trl]]
    assert values == [v for s in scores for v in s.per_function[per_sample]]
    assert len(set(values)) > 1  # the completions differ in length: the comparison is not vacuous
    assert all(s.errors == 0 for s in scores)

    # completion lengths (TRL's names) are those of what was trained on; a few completions per step are
    # logged with every function's score (issue 25)
    for row, batch in zip(steps, batches):
        lengths = [len(c) for c in batch.completion_ids]
        assert row["completions/mean_length"] == sum(lengths) / len(lengths)
        assert (row["completions/min_length"], row["completions/max_length"]) == (min(lengths), max(lengths))
        assert 0 <= row["completions/clipped_ratio"] <= 1 and row["completions/turn_mean_length"] is None
    logged = [json.loads(x) for x in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1] * 4 + [2] * 4 + [3] * 4
    # keyed by each function's one short name (metrics, `raygrpo show`), not by its spec
    assert all(r["rewards"].keys() == {"gsm8k", "length_trl", "length_per_sample"}
               and r["finish_reason"] in ("stop", "length") for r in logged)


@pytest.fixture(autouse=True)
def _quiet_datasets():
    datasets.disable_progress_bars()
