"""Dataset files (JSONL / JSON / parquet / save_to_disk), conversational prompts rendered with a real
chat template, the prompt-length filter, and errors naming file and line."""
from __future__ import annotations

import json

import pytest

from cluster.config import ConfigError, load_config
from cluster.data.dataset import DataError, load_examples, load_run_data
from cluster.data.render import PromptFormat, render
from cluster.models.tinychat import TinyChatSpec, build_bpe_tokenizer
from cluster.models.wordproblems import conversational_rows, write_jsonl

ROWS = conversational_rows(6, seed=1)


@pytest.fixture(scope="module")
def tokenizer():
    return build_bpe_tokenizer(TinyChatSpec())


def _cfg(train, *overrides):
    return load_config(None, [f"data.train={train}", "data.num_eval=2", "rollout.max_model_len=128",
                              "rollout.max_new_tokens=32", *overrides], validate_paths=False)


def test_jsonl_parquet_json_and_saved_dirs_load_the_same_rows(tmp_path):
    import datasets

    jsonl = write_jsonl(tmp_path / "d.jsonl", ROWS)
    ds = datasets.Dataset.from_list(ROWS)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds, "test": ds.select(range(2))}).save_to_disk(str(tmp_path / "dict"))
    expected = load_examples(str(jsonl))
    assert [e.prompt for e in expected] == [r["prompt"] for r in ROWS]
    assert expected[0].fields == {"answer": ROWS[0]["answer"]}
    for other in ("d.parquet", "d.json", "saved", "dict"):
        assert load_examples(str(tmp_path / other)) == expected, other
    assert load_examples(str(tmp_path / "dict"), split="eval") == expected[:2]  # the "test" split
    both = load_examples(f"{jsonl}, {tmp_path / 'd.parquet'}")  # a comma-separated list is concatenated
    assert both == expected + expected


def test_bad_rows_are_named_by_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": [{"role": "user"}]}\nnot json\n'
                 '{"question": "x"}\n[1]\n')
    with pytest.raises(DataError) as e:
        load_examples(str(p))
    msg = str(e.value)
    for line in (2, 3, 4, 5):
        assert f"{p}:{line}:" in msg
    assert f"{p}:1:" not in msg and "data.prompt_key" in msg


def test_non_utf8_bytes_are_named_by_line(tmp_path):
    p = tmp_path / "latin1.jsonl"
    p.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError, match=rf"{p}:2: not UTF-8 \(byte 0xe9"):
        load_examples(str(p))


def test_parquet_bad_row_named_by_row(tmp_path):
    import datasets

    datasets.Dataset.from_list([{"prompt": "a"}, {"prompt": ""}]).to_parquet(str(tmp_path / "p.parquet"))
    with pytest.raises(DataError, match=r"p.parquet row 1: the prompt is an empty string"):
        load_examples(str(tmp_path / "p.parquet"))


def test_content_lists_of_text_parts_load_as_strings_and_render_as_vllm_joins_them(tmp_path, tokenizer):
    """OpenAI's content format ([{"type": "text", "text": ...}, ...]), as JSONL and as parquet (whose structs
    give every part every key, null where it has none): loaded as one string per message, the parts joined
    with newlines as vLLM joins them for a template that takes strings; other message keys kept."""
    import datasets

    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "Tom has 3 apples."}, {"text": "How many?"}]}]
    strings = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tom has 3 apples.\nHow many?"}]
    jsonl = write_jsonl(tmp_path / "parts.jsonl", [{"prompt": parts, "answer": "3"}, {"prompt": strings, "answer": "3"}])
    a, b = load_examples(str(jsonl))
    assert a.prompt == b.prompt == strings and a.fields == {"answer": "3"}
    assert render([a.prompt], tokenizer, PromptFormat()) == render([strings], tokenizer, PromptFormat())
    with_image_key = [{"role": "user", "content": [{"type": "text", "text": "2+2?", "image": None}]}]
    datasets.Dataset.from_list([{"prompt": with_image_key}]).to_parquet(str(tmp_path / "parts.parquet"))
    (c,) = load_examples(str(tmp_path / "parts.parquet"))
    assert c.prompt == [{"role": "user", "content": "2+2?"}]


def test_a_content_part_that_is_not_text_is_refused_naming_it(tmp_path):
    p = write_jsonl(tmp_path / "image.jsonl", [
        {"prompt": [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                                 {"type": "image_url", "image_url": {"url": "x.png"}}]}]},
        {"prompt": [{"role": "user", "content": 7}]}])
    with pytest.raises(DataError) as e:
        load_examples(str(p))
    msg = str(e.value)
    assert (f"{p}:1: message 0 has a content part of type 'image_url': raygrpo trains text models, so a content list "
            "may hold only text parts") in msg
    assert f"{p}:2: message 0's \"content\" must be a string or a list of text parts, got 7" in msg


def test_prompt_key_and_other_columns(tmp_path):
    p = write_jsonl(tmp_path / "q.jsonl", [{"question": "2+2?", "solution": "#### 4", "level": 1}])
    (ex,) = load_examples(str(p), prompt_key="question")
    assert ex.prompt == "2+2?" and ex.fields == {"solution": "#### 4", "level": 1}


# --------------------------------------------------------------------------- rendering
def test_rendering_equals_apply_chat_template(tokenizer):
    (text, ids), = render([ROWS[0]["prompt"]], tokenizer, PromptFormat())
    assert ids == tokenizer.apply_chat_template(ROWS[0]["prompt"], add_generation_prompt=True, return_dict=True)["input_ids"]
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")


def test_strings_are_used_as_they_are_unless_asked(tokenizer):
    (text, ids), = render(["Tom has 3 apples."], tokenizer, PromptFormat())
    assert text == "Tom has 3 apples." and tokenizer.decode(ids) == text
    (text, _), = render(["Tom has 3 apples."], tokenizer, PromptFormat(apply_chat_template=True, system_prompt="Be brief."))
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nTom has 3 apples.<|im_end|>\n<|im_start|>assistant\n"


def test_system_prompt_only_where_there_is_none(tokenizer):
    user_only = [{"role": "user", "content": "hi"}]
    texts = [t for t, _ in render([user_only, ROWS[0]["prompt"]], tokenizer, PromptFormat(system_prompt="SYS"))]
    assert texts[0].startswith("<|im_start|>system\nSYS<|im_end|>")
    assert "SYS" not in texts[1]  # it has its own system message


def test_chat_template_kwargs_reach_the_template(tokenizer):
    tok = build_bpe_tokenizer(TinyChatSpec())
    tok.chat_template = tokenizer.chat_template + "{% if enable_thinking is defined and not enable_thinking %}<no_think>{% endif %}"
    (text, _), = render([[{"role": "user", "content": "hi"}]], tok, PromptFormat(chat_template_kwargs={"enable_thinking": False}))
    assert text.endswith("<no_think>")


def test_chat_data_without_a_chat_template_is_an_error(tokenizer):
    tok = build_bpe_tokenizer(TinyChatSpec())
    tok.chat_template = None
    with pytest.raises(DataError, match="no chat template"):
        render([[{"role": "user", "content": "hi"}]], tok, PromptFormat())
    with pytest.raises(DataError, match="data.apply_chat_template"):
        render(["hi"], tokenizer, PromptFormat(system_prompt="SYS"))


# --------------------------------------------------------------------------- the run's data
def test_long_prompts_are_filtered_and_counted(tmp_path, tokenizer):
    rows = ROWS[:4] + [{"prompt": [{"role": "user", "content": "apples " * 200}], "answer": "#### 1"}]
    p = write_jsonl(tmp_path / "long.jsonl", rows)
    data = load_run_data(_cfg(p), tokenizer)
    assert len(data.train) == 4 and data.heldout == []
    (report,) = data.reports
    assert report.rows == 5 and report.filtered == 1 and report.limit == 128 - 32 and report.longest_filtered > 200
    assert "filtered 1 of 5 train prompts longer than 96 tokens" in data.notes()[0]
    assert all(e.prompt_ids == tokenizer.apply_chat_template(e.prompt, add_generation_prompt=True, return_dict=True)["input_ids"]
               for e in data.train)
    with pytest.raises(DataError, match=r"long.jsonl:5: \d+ tokens"):
        load_run_data(_cfg(p, "data.long_prompts=error"), tokenizer)


def test_every_prompt_filtered_is_an_error_before_training(tmp_path, tokenizer):
    p = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(DataError, match="every train prompt .* is longer than 10 tokens"):
        load_run_data(_cfg(p, "data.max_prompt_tokens=10"), tokenizer)


def test_eval_is_capped_after_filtering_and_tasks_still_work(tmp_path, tokenizer):
    p = write_jsonl(tmp_path / "d.jsonl", ROWS)
    data = load_run_data(_cfg(p, f"data.eval={p}"), tokenizer)
    assert len(data.train) == 6 and len(data.heldout) == 2 and [r.name for r in data.reports] == ["train", "eval"]
    task = load_run_data(_cfg("task:addition", "data.task_digits=1"), tokenizer)
    assert len(task.heldout) == 2 and task.train[0].prompt_ids == tokenizer(task.train[0].prompt)["input_ids"]


def test_config_checks_dataset_paths(tmp_path):
    (tmp_path / "d.csv").write_text("prompt\nx\n")
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"data.train={tmp_path / 'd.csv'}, {tmp_path / 'missing.jsonl'}", "data.long_prompts=drop",
                           "data.max_prompt_tokens=500"], validate_paths=True)
    msg = str(e.value)
    assert "unsupported file type '.csv'" in msg and "missing.jsonl' does not exist" in msg
    assert "data.long_prompts must be filter|error" in msg and "data.max_prompt_tokens (500) >" in msg
