"""`raygrpo data`, and data errors that `raygrpo train` reports before any actor starts (exit 2)."""
from __future__ import annotations

from cluster.cli import main
from cluster.models.wordproblems import conversational_rows, write_jsonl


def _config(tmp_path, model_dir, train) -> str:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {{path: {model_dir}}}\ndata: {{train: {train}}}\ntrainer: {{run_dir: {tmp_path / 'run'}}}\n"
                   "rollout: {max_model_len: 96, max_new_tokens: 16}\nreward: {functions: [gsm8k]}\n")
    return str(cfg)


def test_data_command_shows_prompts_as_the_engine_gets_them(tmp_path, tiny_chat_model_dir, capsys):
    rows = conversational_rows(5) + [{"prompt": [{"role": "user", "content": "apples " * 100}], "answer": "#### 1"}]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    assert main(["data", _config(tmp_path, tiny_chat_model_dir, data), "-n", "2", "data.system_prompt=Be brief."]) == 0
    out = capsys.readouterr().out
    assert "train: 6 rows, 1 filtered (> 80 prompt tokens), prompt tokens p50" in out
    assert "filtered 1 of 6 train prompts longer than 80 tokens" in out
    assert out.count("as the engine receives it") == 2
    assert "<|im_start|>system\nSolve the problem." in out and "<|im_start|>assistant\n" in out
    assert "answer: '" in out and "#### " in out
    assert "generation stops at token ids [2, 0]" in out
    assert not (tmp_path / "run").exists()  # nothing trained, nothing written


def test_non_utf8_dataset_is_named_by_file_and_line(tmp_path, tiny_chat_model_dir, capsys):
    data = tmp_path / "latin1.jsonl"
    data.write_bytes(b'{"prompt": "ok", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n')
    assert main(["train", _config(tmp_path, tiny_chat_model_dir, data)]) == 2
    err = capsys.readouterr().err
    assert f"{data}:2: not UTF-8" in err and "Traceback" not in err


def test_every_prompt_filtered_is_an_error_before_training(tmp_path, tiny_chat_model_dir, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", conversational_rows(3))
    assert main(["train", _config(tmp_path, tiny_chat_model_dir, data), "data.max_prompt_tokens=8"]) == 2
    err = capsys.readouterr().err
    assert "every train prompt" in err and "longer than 8 tokens" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_data_shows_reward_columns_whole_and_what_each_answer_checker_reads(tmp_path, tiny_chat_model_dir, capsys):
    """A GSM8K solution is longer than a line: the "#### N" that gsm8k reads is at its end, so the column
    is shown whole, with each configured checker's reading of it."""
    solution = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n" * 4 + "Natalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": [{"role": "user", "content": "How many clips?"}],
                                               "answer": solution}])
    assert main(["data", _config(tmp_path, tiny_chat_model_dir, data), "-n", "1",
                 "reward.functions=[gsm8k,math_verify,exact_match]"]) == 0
    out = capsys.readouterr().out
    assert repr(solution) in out  # whole, not cut at 100 characters
    assert "    gsm8k gold: 72\n    math_verify gold: 72\n    exact_match gold: not a number" in out


def test_data_shows_the_environment_and_a_reward_from_it_alone(tmp_path, tiny_chat_model_dir, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", conversational_rows(3))
    assert main(["data", _config(tmp_path, tiny_chat_model_dir, data), "-n", "1", "rollout.env=calculator",
                 "rollout.max_turns=3", "reward.functions=[]"]) == 0
    out = capsys.readouterr().out
    assert "rollout.env: calculator (an instance per trajectory" in out and "rollout.max_turns 3" in out
    assert "reward.functions: none (the environment's rewards only)" in out and "_messages, _turns" in out
    # without an environment an empty reward.functions has nothing to score with
    assert main(["data", _config(tmp_path, tiny_chat_model_dir, data), "reward.functions=[]"]) == 2
    assert "reward.functions is empty" in capsys.readouterr().err
