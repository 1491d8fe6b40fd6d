"""Math answer rewards (gsm8k, math_verify), TRL-style batched functions, held-out verdicts."""
from __future__ import annotations

import textwrap
import threading

import pytest

from actors.completions import Completion
from actors.config import RewardConfig
from actors.rewards.functions import gsm8k, math_verify
from actors.rewards.pool import is_batched
from actors.rewards.scorer import RewardScorer


# --------------------------------------------------------------------------- gsm8k
@pytest.mark.parametrize("completion", ["3 + 4 = 7\n#### 7", "#### 7.0", "####7", "#### $7", "#### 5\nno wait\n#### 7"])
def test_gsm8k_correct(completion):
    assert gsm8k("", completion, answer="Tom has 3 + 4 = 7 apples.\n#### 7") == 1.0


@pytest.mark.parametrize("completion", ["7", "the answer is 7", "#### 8", "#### 7\n#### 8", ""])
def test_gsm8k_wrong_or_unmarked(completion):
    assert gsm8k("", completion, answer="#### 7") == 0.0


def test_gsm8k_commas_plain_answers_and_answer_key():
    assert gsm8k("", "#### 1,000", answer="#### 1000") == 1.0
    assert gsm8k("", "#### 1000", answer="1,000") == 1.0  # a plain number in the answer field
    assert gsm8k("", "#### -3", answer=-3) == 1.0
    assert gsm8k("", "#### 72", _answer_key="solution", solution="... #### 72") == 1.0
    with pytest.raises(KeyError, match="solution"):
        gsm8k("", "#### 72", _answer_key="solution", answer="#### 72")
    with pytest.raises(ValueError, match="no '#### <number>'"):
        gsm8k("", "#### 72", answer="seventy-two")


# --------------------------------------------------------------------------- math_verify
def test_math_verify_boxed_fraction_equals_decimal():
    assert math_verify("", "so the answer is \\boxed{1/2}", answer="0.5") == 1.0
    assert math_verify("", "\\boxed{\\frac{1}{2}}", answer="$0.5$") == 1.0
    assert math_verify("", "\\boxed{1/3}", answer="0.5") == 0.0
    assert math_verify("", "#### 72", answer="Some work.\n#### 72") == 1.0  # GSM8K-style gold


def test_math_verify_works_off_the_main_thread():
    """Its default timeouts use signal.alarm, which raises off the main thread (the driver scores in a thread)."""
    out = []
    t = threading.Thread(target=lambda: out.append(math_verify("", "\\boxed{1/2}", answer="0.5")))
    t.start()
    t.join(60)
    assert out == [1.0]


def test_math_verify_through_the_scorer_process_pool():
    with RewardScorer(RewardConfig(functions=["math_verify"], num_procs=1)) as scorer:
        res = scorer.score(["q", "q"], ["\\boxed{1/2}", "\\boxed{2}"], [{"answer": "0.5"}] * 2)
    assert res.rewards == [1.0, 0.0] and res.errors == 0


# --------------------------------------------------------------------------- TRL-style functions
USER_CODE = textwrap.dedent("""
    def per_sample(prompt, completion, answer):
        return len(completion) / 10 + (1.0 if completion.endswith(str(answer)) else 0.0)

    def trl_style(prompts, completions, answer, **kwargs):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [len(t) / 10 + (1.0 if t.endswith(str(a)) else 0.0) for t, a in zip(texts, answer)]

    def what_trl_passes(prompts, completions, completion_ids, answer, _num_tokens):
        ok = all(isinstance(p, list) and p[-1]["role"] == "user" for p in prompts)
        ok = ok and all(c == [{"role": "assistant", "content": c[0]["content"]}] for c in completions)
        ok = ok and [len(i) for i in completion_ids] == _num_tokens
        return [1.0 if ok else 0.0] * len(prompts)

    def some_none(completions, **kwargs):
        return [None if i % 2 else 1.0 for i in range(len(completions))]

    def wrong_length(prompts, completions, **kwargs):
        return [1.0]
""")


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("trl") / "trl_rewards.py"
    path.write_text(USER_CODE)
    return str(path)


COMPLETIONS = ["#### 7", "it is 8", "", "7"]
CHAT = [[{"role": "system", "content": "Solve."}, {"role": "user", "content": f"q{i}"}] for i in range(4)]


def _completion(text: str) -> Completion:
    return Completion(list(range(len(text) + 1)), [-0.1] * (len(text) + 1), text, "stop")


@pytest.mark.parametrize("prompts", [["q"] * 4, CHAT], ids=["string prompts", "conversational prompts"])
def test_trl_style_and_per_sample_functions_give_the_same_rewards(user_file, prompts):
    examples = [{"answer": "7"}] * 4
    comps = [_completion(t) for t in COMPLETIONS]
    with RewardScorer(RewardConfig(functions=[f"{user_file}:per_sample", f"{user_file}:trl_style"],
                                   weights=[1.0, 0.0], num_procs=2)) as scorer:
        res = scorer.score(prompts, comps, examples)
    assert res.errors == 0
    per, trl = res.per_function[f"{user_file}:per_sample"], res.per_function[f"{user_file}:trl_style"]
    assert per == trl == [pytest.approx(v) for v in (1.6, 0.7, 0.0, 1.1)]


def test_trl_style_function_receives_what_trl_passes(user_file):
    with RewardScorer(RewardConfig(functions=[f"{user_file}:what_trl_passes"], num_procs=1)) as scorer:
        res = scorer.score(CHAT, [_completion(t) for t in COMPLETIONS], [{"answer": "7"}] * 4)
    assert res.rewards == [1.0] * 4 and res.errors == 0


def test_trl_style_none_adds_nothing_and_a_wrong_length_is_an_error(user_file):
    with RewardScorer(RewardConfig(functions=[f"{user_file}:some_none", "exact_match"], num_procs=1)) as scorer:
        res = scorer.score(["q"] * 4, COMPLETIONS, [{"answer": "7"}] * 4)
    assert res.rewards == [2.0, 0.0, 1.0, 1.0] and res.errors == 0
    with RewardScorer(RewardConfig(functions=[f"{user_file}:wrong_length"], num_procs=1, fallback=-1.0)) as scorer:
        res = scorer.score(["q"] * 3, ["a", "b", "c"], [{}] * 3)
    assert res.rewards == [-1.0] * 3 and res.errors == 3 and "not a list of 3" in res.error_samples[0]


def test_is_batched():
    assert is_batched(lambda prompts, completions, **kw: []) and is_batched(lambda completions, **kw: [])
    assert not is_batched(lambda prompt, completion, **kw: 0.0)


# --------------------------------------------------------------------------- held-out verdicts
def test_judge_uses_the_configured_answer_checker():
    comps = ["#### 7", "7", "#### 8"]
    examples = [{"answer": "x\n#### 7"}] * 3
    scorer = RewardScorer(RewardConfig(functions=["format", "gsm8k"]))
    assert scorer.judge(["q"] * 3, comps, examples) == [True, False, False]
    # no checker configured, data has answers: exact_match's verdict
    plain = RewardScorer(RewardConfig(functions=["format"]))
    assert plain.judge(["q"] * 2, ["7", "8"], [{"answer": "7"}] * 2) == [True, False]
