"""Issue 30, the bad inputs, through the CLI as they were found: each is a clear message before any
actor starts (or, for an actor that cannot start, the actor's own error), exit 2 for bad input.

Everything runs `raygrpo` as a user does: the installed console script, configs and data in a
directory of the user's outside the checkout, relative paths in the config.
"""
from __future__ import annotations

import json
import shutil

import pytest
import yaml
from console import full_disk_wrapper, run

pytestmark = pytest.mark.timeout(900)


def base_config(model: str, run_dir: str = "runs/r", **sections) -> dict:
    cfg = {"model": {"path": model}, "data": {"num_eval": 0, "task_digits": 1},
           "trainer": {"steps": 1, "prompts_per_step": 4, "group_size": 4, "run_dir": run_dir, "actor_timeout_s": 600},
           "rollout": {"max_model_len": 48, "max_new_tokens": 6, "gpu_memory_utilization": 0.03},
           "learner": {"lr": 1.0e-3, "micro_batch_size": 8}, "metrics": {"tensorboard": False},
           "reward": {"functions": ["exact_match"]}}
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


@pytest.fixture
def home(tmp_path, tiny_model_dir):
    """A user's directory: a copy of the tiny model as `model/`, configs written there."""
    shutil.copytree(tiny_model_dir, tmp_path / "model")
    return tmp_path


def write(home, cfg: dict, name: str = "run.yaml") -> str:
    (home / name).write_text(yaml.safe_dump(cfg))
    return name


def edit_json(path, **changes):
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def test_a_model_dir_without_tokenizer_files_is_refused_before_any_actor(home):
    """Case 4: it "trained" and exited 0 on 0-token prompts; `raygrpo data` showed "0 tokens" without a word."""
    for f in (home / "model").glob("tokenizer*"):
        f.unlink()
    cfg = write(home, base_config("model"))
    for command in ("train", "data"):
        out = run([command, cfg], home)
        assert out.returncode == 2, out.text[-2000:]
        assert "its tokenizer has no vocabulary" in out.text and "tokenizer files" in out.text, out.text[-2000:]
        assert "Traceback" not in out.text and "waiting on" not in out.text  # no actor was started
    assert not (home / "runs" / "r" / "checkpoints").exists()


def test_max_model_len_lora_targets_and_num_ranks_are_checked_at_validation(home):
    """Cases 9 and 11: rollout.max_model_len above the model's positions (a pydantic traceback inside the
    engine), learner.lora_target_modules that match nothing (found inside the learner), and
    learner.num_ranks=0 ("integer modulo by zero"): one message, exit 2, before anything starts."""
    cfg = write(home, base_config("model"))
    out = run(["train", cfg, "rollout.max_model_len=4096", "learner.lora_rank=8", "learner.lora_target_modules=[c_attn]",
               "learner.num_ranks=0"], home)
    assert out.returncode == 2, out.text[-2000:]
    assert "rollout.max_model_len (4096) is longer than the model takes (max_position_embeddings=512 in config.json" in out.text
    assert "learner.lora_target_modules ['c_attn'] match no module of the model" in out.text and "q_proj" in out.text
    assert "learner.num_ranks must be >= 1, got 0" in out.text and "modulo" not in out.text
    assert "Traceback" not in out.text


def test_a_missing_answer_column_is_found_at_load(home, tiny_chat_model_dir):
    """Case 11: gsm8k without the answer column failed at step 1 although `raygrpo data` warned."""
    rows = [{"prompt": [{"role": "user", "content": f"Tom has {a} apples and gets 2 more. How many?"}],
             "solution": f"#### {a + 2}"} for a in range(8)]
    (home / "problems.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = write(home, base_config(str(tiny_chat_model_dir), data={"train": "problems.jsonl"},
                                  rollout={"max_model_len": 96}, reward={"functions": ["gsm8k"]}))
    out = run(["train", cfg], home)
    assert out.returncode == 2, out.text[-2000:]
    assert "8 of 8 train rows have no 'answer' column (reward.answer_key), which gsm8k compare(s) against" in out.text
    assert "problems.jsonl:1" in out.text and "solution" in out.text and "waiting on" not in out.text
    shown = run(["data", cfg], home)
    assert shown.returncode == 0 and "ERROR (`raygrpo train` refuses this data)" in shown.text
    fixed = run(["data", cfg, "reward.answer_key=solution"], home)
    assert fixed.returncode == 0 and "ERROR" not in fixed.text


def test_a_user_reward_functions_missing_column_is_found_at_load(home, tiny_chat_model_dir):
    """Case 11 (each reward's required columns at load): a user function with a parameter the data lacks
    failed on every sample of step 1, after every actor had started. Its source is read, never run."""
    (home / "my_rewards.py").write_text("def by_level(prompt, completion, level, **kw):\n"
                                        "    return float(len(completion) < 10 * level)\n")
    rows = [{"prompt": [{"role": "user", "content": f"Say {a}."}], "answer": str(a)} for a in range(8)]
    (home / "problems.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = write(home, base_config(str(tiny_chat_model_dir), data={"train": "problems.jsonl"},
                                  rollout={"max_model_len": 96}, reward={"functions": ["my_rewards.py:by_level"]}))
    out = run(["train", cfg], home)
    assert out.returncode == 2, out.text[-2000:]
    assert f"reward function {home / 'my_rewards.py'}:by_level takes 'level' (a parameter without a default), a " \
           "column 8 of 8 train rows lack; e.g." in out.text
    assert "problems.jsonl:1" in out.text and "waiting on" not in out.text and not (home / "runs/r/config.yaml").exists()
    shown = run(["data", cfg], home)
    assert shown.returncode == 0 and "ERROR (`raygrpo train` refuses this data): reward function" in shown.text


def test_an_unknown_role_is_warned_and_an_override_with_a_hash_is_taken_whole(home, tiny_chat_model_dir):
    """Case 11: a message role "wizard" was accepted silently. Case 12: overrides are YAML, so
    `data.system_prompt=Solve it. End with #### and the number.` silently became "Solve it. End with"."""
    rows = [{"prompt": [{"role": "wizard", "content": "Speak in riddles."},
                        {"role": "user", "content": "Tom has 3 apples and gets 2 more. How many?"}], "answer": "#### 5"},
            {"prompt": "Tom has 1 apple and gets 2 more. How many?", "answer": "#### 3"}]
    (home / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = write(home, base_config(str(tiny_chat_model_dir), data={"train": "rows.jsonl", "apply_chat_template": True},
                                  rollout={"max_model_len": 128}))
    out = run(["data", cfg, "data.system_prompt=Solve it. End with #### and the number.", "-n", "2"], home)
    assert out.returncode == 0, out.text[-2000:]
    assert "warning: 1 train prompt(s) have messages with a role chat templates do not know ('wizard'" in out.text
    assert "rows.jsonl:1" in out.text
    assert "Solve it. End with #### and the number." in out.text  # the system prompt, whole, in the rendered prompt


def test_a_full_disk_under_tensorboard_names_the_path_and_the_free_space(home):
    """Case 8: a full disk with TensorBoard on (the default) gave a 40-line traceback without the path.
    The run dir's tensorboard/ is on a full filesystem; the metrics logger opens before any actor starts."""
    run_dir = home / "runs" / "r"
    (run_dir / "tensorboard").mkdir(parents=True)
    wrap = full_disk_wrapper(run_dir / "tensorboard")
    if wrap is None:
        pytest.skip("this machine cannot mount a private tmpfs (no root and no user namespaces)")
    cfg = write(home, base_config("model", metrics={"tensorboard": True}))
    out = run(["train", cfg], home, wrap=wrap)
    assert out.returncode == 1, out.text[-3000:]
    assert f"could not write {run_dir / 'tensorboard'}: the disk is full" in out.text, out.text[-3000:]
    assert "0 MiB free on that filesystem" in out.text
    assert "Traceback" not in out.text and "Exception in thread" not in out.text, out.text[-3000:]
    assert "waiting on" not in out.text  # found before any actor started


def test_an_actor_that_cannot_start_is_reported_with_its_own_error(home):
    """Case 9, "otherwise": a startup error inside an actor arrived as "actor died ... in its creation task"
    with the cause only in the actor's log. A model whose attention heads are 16 wide (vLLM's CPU
    attention needs 32): the engine refuses it while starting."""
    edit_json(home / "model" / "config.json", num_attention_heads=8, num_key_value_heads=4)  # same weights
    out = run(["train", write(home, base_config("model"))], home)
    out.report("an actor that cannot start")
    assert out.returncode == 1, out.text[-3000:]
    last = [line for _, line in out.lines if line.startswith("raygrpo: ")][-1]
    assert "rollout worker 0 died while starting its vLLM engine" in last, last
    assert "RuntimeError: Unsupported CPU attention configuration: head_dim=16" in last, last
    assert "\x1b[" not in last
