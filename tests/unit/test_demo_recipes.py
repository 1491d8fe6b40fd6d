"""The demo recipes' parts that need no engines: their data, the tools warm start's loss mask, the CLI."""
from __future__ import annotations

import json

import pytest

from cluster.cli import build_parser
from cluster.data.dataset import Example
from cluster.demo.demo import DEMO_MARK, made_by_a_demo
from cluster.demo.recipes import RECIPES
from cluster.models.tasks import chat_rows, conversation_sequence, tool_rows
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
    assert names["addition"] == names["lora"] == names["async"] == "warm-to0.25-seed2-threads1"
    assert len({names["addition"], names["chat"], names["tools"]}) == 3


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
