"""The code_tests reward kind (actors/rewards/code.py): both dataset shapes, scores, the per-test outcomes in
completions.jsonl and `raygrpo show`, the config's checks, and `raygrpo score` (cluster/score.py) through the
CLI. The programs run in the strict sandbox where this machine has it, else in the process level (the
hostile programs are test_code_sandbox.py's)."""
from __future__ import annotations

import json

import pytest

from actors.completions import Completion, PromptRollout
from actors.config import RewardConfig
from actors.rewards import code
from actors.rewards.scorer import RewardScorer
from actors.runtime.sandbox import probe
from cluster import cli
from cluster.data.dataset import Example
from cluster.run import completions

LEVEL = "strict" if probe("strict") is None else "process"
HUMANEVAL = {"test": "METADATA = {}\n\ndef check(candidate):\n    assert candidate([1, 2]) == 3\n"
                     "    assert candidate([]) == 0\n    assert candidate([5]) == 5\n",
             "entry_point": "total"}
HUMANEVAL_PROMPT = 'def total(xs):\n    """The sum of xs."""\n'
MBPP = {"test_list": ["assert is_even(2)", "assert not is_even(3)", "assert is_even(0)"],
        "test_setup_code": "import math"}


@pytest.fixture(scope="module")
def scorer():
    with RewardScorer(RewardConfig(functions=["code_tests"], code_sandbox=LEVEL, code_timeout_s=5.0)) as s:
        yield s


def score(scorer, prompts, texts, rows):
    result = scorer.score(prompts, texts, rows)
    return result.rewards, result.tests


def test_correct_solutions_score_1_in_both_shapes(scorer):
    rewards, tests = score(
        scorer, [HUMANEVAL_PROMPT, HUMANEVAL_PROMPT, "Write is_even."],
        ["    return sum(xs)\n",  # continues the prompt's signature
         "Here it is:\n```python\ndef total(xs):\n    out = 0\n    for x in xs:\n        out += x\n    return out\n```",
         "```python\ndef is_even(n):\n    return n % 2 == 0\n```"],
        [HUMANEVAL, HUMANEVAL, MBPP])
    assert rewards == [1.0, 1.0, 1.0]
    assert [len(t) for t in tests] == [3, 3, 3]  # check()'s three asserts are three tests
    assert all(t["outcome"] == "passed" for row in tests for t in row)


def test_broken_solutions_score_below_1_with_the_failing_tests_named(scorer):
    rewards, tests = score(scorer, [HUMANEVAL_PROMPT, "Write is_even."],
                           ["```python\ndef total(xs):\n    return xs[0] if xs else 0\n```",
                            "```python\ndef is_even(n):\n    return n == 2\n```"], [HUMANEVAL, MBPP])
    assert rewards == [pytest.approx(2 / 3), pytest.approx(2 / 3)]
    failed = [[(t["test"], t["outcome"]) for t in row if t["outcome"] != "passed"] for row in tests]
    assert failed == [[("assert candidate([1, 2]) == 3", "failed")], [("assert is_even(0)", "failed")]]


def test_all_or_nothing_and_errors_named():
    with RewardScorer(RewardConfig(functions=["code_tests"], code_sandbox=LEVEL, code_score="all")) as s:
        rewards, tests = score(s, ["p", "p"], ["def is_even(n):\n    return n == 2", "def is_even(n): return n.x"],
                               [MBPP, MBPP])
    assert rewards == [0.0, 0.0]
    assert tests[1][0]["outcome"] == "error" and tests[1][0]["detail"].startswith("AttributeError")


def test_a_row_without_its_tests_column_is_an_error_naming_it(scorer, capsys):
    result = scorer.score(["p"], ["def f(): pass"], [{"question": "?"}])
    assert result.errors == 1 and "'test' (reward.code_tests_key)" in result.error_samples[0]


def test_the_program_is_the_last_fenced_block_else_the_whole_completion():
    assert code.program_of("a\n```python\nx = 1\n```\nb\n```py\nx = 2\n```\n") == "x = 2\n"
    assert code.program_of("x = 3") == "x = 3"


def test_the_columns_are_config_keys():
    cfg = RewardConfig(code_tests_key="checks", code_entry_point_key="fn")
    program, tests = code.tests_of("", "def g(x): return x", {"checks": HUMANEVAL["test"], "fn": "g"}, cfg)
    assert len(tests) == 3 and tests[0][1].endswith("check(g)")
    assert code.row_format({"checks": ["assert 1"]}, cfg) == "mbpp"


def test_bad_code_settings_are_named():
    problems = RewardConfig(code_format="apps", code_score="most", code_sandbox="none", code_workers=0).problems()
    text = "; ".join(problems)
    for key in ("reward.code_format", "reward.code_score", "reward.code_sandbox", "reward.code_workers"):
        assert key in text


def test_tests_reach_completions_jsonl_and_show(tmp_path):
    live = [(Example("Write is_even.", MBPP), PromptRollout([1], [1], [Completion([5], [-0.1], "def is_even(n): ...",
                                                                                      "stop")], weight_version=0))]
    tests = [[{"test": "assert is_even(2)", "outcome": "timeout", "detail": "past 5 s"}]]
    rows = completions.sample_rows(live, [0.0], {"code_tests": [0.0]}, [0.0], 1, 1, tests)
    assert rows[0]["tests"] == tests[0]
    completions.write_rows(tmp_path, 1, rows)
    shown = []
    completions.show(tmp_path, None, None, out=shown.append)
    assert "timeout      assert is_even(2): past 5 s" in "\n".join(shown)


def test_raygrpo_score_through_the_cli(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "Write is_even.", "completion": "```python\ndef is_even(n):\n    return n % 2 == 0\n```", **MBPP},
        {"prompt": "Write is_even.", "completion": "def is_even(n):\n    return n == 2", **MBPP},
        {"prompt": "2+2?", "completion": "4", **MBPP, "answer": "4"},
    ]) + "\n")
    out = tmp_path / "scores.jsonl"
    rc = cli.main(["score", "examples/cpu_demo.yaml", str(rows), "reward.functions=[code_tests,exact_match]",
                   f"reward.code_sandbox={LEVEL}", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "row 2: reward" in printed and "failed       assert is_even(0)" in printed
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["rewards"]["code_tests"] for r in got] == [1.0, pytest.approx(2 / 3), 0.0]
    assert got[0]["rewards"]["exact_match"] is None  # no answer column: that function failed on the row
    assert got[2]["rewards"]["exact_match"] == 1.0
    assert [t["outcome"] for t in got[1]["tests"]] == ["passed", "passed", "failed"]
    assert set(got[0]) == {"reward", "rewards", "tests"}


def test_raygrpo_score_refuses_a_bad_row(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "no completion"}\n')
    assert cli.main(["score", "examples/cpu_demo.yaml", str(rows)]) == 2
    assert "rows.jsonl:1: each line must be a JSON object with a `completion`" in capsys.readouterr().err


def test_held_out_evaluation_counts_a_program_correct_only_when_every_test_passed(scorer):
    verdicts = scorer.judge(["p"] * 2, ["def is_even(n):\n    return n % 2 == 0", "def is_even(n):\n    return n == 2"],
                            [MBPP, MBPP])
    assert verdicts == [True, False]  # the second passes 2 of 3: a reward of 2/3, not a pass


def test_a_prompts_humaneval_tests_are_split_once_for_all_its_completions():
    """The G completions of one prompt share its tests: check() is parsed and split once, and each sample
    gets its own list (a caller appending to one cannot change another's)."""
    code._check_asserts.cache_clear()
    cfg = RewardConfig(functions=["code_tests"])
    first = code.tests_of(HUMANEVAL_PROMPT, "    return sum(xs)\n", HUMANEVAL, cfg)[1]
    second = code.tests_of(HUMANEVAL_PROMPT, "    return 0\n", HUMANEVAL, cfg)[1]
    assert [name for name, _ in first] == ["assert candidate([1, 2]) == 3", "assert candidate([]) == 0",
                                           "assert candidate([5]) == 5"]
    assert first == second and first is not second
    assert code._check_asserts.cache_info().hits == 1
