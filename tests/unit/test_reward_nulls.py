"""Null rewards and names (actors/rewards/scorer.py combine, actors/rewards/registry.py): a null leaves its sample out
of its group (never 0); a function null for a whole group does not apply there; every entry gets a name."""
from __future__ import annotations

import math
import textwrap

import pytest

from actors.config import RewardConfig
from actors.rewards import model
from actors.rewards.model import model_dir_problems
from actors.rewards.registry import default_name, kind_for, spec_problems
from actors.rewards.scorer import RewardScorer, combine
from actors.runtime.waits import ActorFailed

N = float("nan")


def _combine(values, group_size=4, weights=None, env=None, with_failed=False):
    n = len(next(iter(values.values())))
    rewards, unscorable, failed = combine(values, weights or dict.fromkeys(values, 1.0), env or [0.0] * n, -1.0,
                                          group_size)
    return (rewards, unscorable, failed) if with_failed else (rewards, unscorable)


def _same(a, b):
    return all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b)) and len(a) == len(b)


def test_a_null_for_some_of_a_group_makes_those_unscorable():
    rewards, out = _combine({"v": [1.0, None, 0.0, None], "f": [0.5, 0.5, 0.5, 0.5]})
    assert _same(rewards, [1.5, N, 0.5, N]) and out == [False, True, False, True]


def test_a_function_null_for_a_whole_group_does_not_apply_there():
    # TRL's multi-task use: "math" has no opinion on group 2's prompt, "code" none on group 1's
    values = {"math": [1.0, 0.0, None, None], "code": [None, None, 0.0, 1.0]}
    rewards, out = _combine(values, group_size=2)
    assert rewards == [1.0, 0.0, 0.0, 1.0] and out == [False] * 4


def test_a_group_no_function_scored_is_unscorable():
    rewards, out = _combine({"v": [None, None, 1.0, 0.0]}, group_size=2)
    assert _same(rewards, [N, N, 1.0, 0.0]) and out == [True, True, False, False]


def test_errors_get_the_fallback_and_environment_rewards_add():
    rewards, out, failed = _combine({"v": [1.0, N, None, 0.0]}, env=[0.25, 0.0, 0.0, 0.0], with_failed=True)
    assert _same(rewards, [1.25, -1.0, N, 0.0]) and out == [False, False, True, False]
    assert failed == [False, True, False, False]


def test_a_function_that_failed_a_whole_group_fails_alone_the_others_renormalised():
    """Issue 36: a broken verifier is left out of the groups it failed; the functions left score them,
    their weights scaled by sum(|w|) / sum(|w| of those left), so the rewards keep their scale."""
    values = {"good": [1.0, 0.0, 1.0, 1.0], "broken": [N, N, 0.5, 0.5]}
    rewards, out, failed = _combine(values, group_size=2, weights={"good": 1.0, "broken": 3.0}, with_failed=True)
    assert rewards == [4.0, 0.0, 2.5, 2.5] and out == [False] * 4 and failed == [False] * 4  # group 1: x (1+3)/1
    # a negative weight counts by its size: the scale stays positive
    rewards, _ = _combine({"good": [1.0, 0.0], "penalty": [N, N]}, group_size=2, weights={"good": 1.0, "penalty": -1.0})
    assert rewards == [2.0, 0.0]
    # a function with no opinion (null for the whole group) is one of those left: its weight counts on both sides
    values = {"good": [1.0, 0.0], "no_opinion": [None, None], "broken": [N, N]}
    assert _combine(values, group_size=2)[0] == [1.5, 0.0]  # x 3/2


def test_a_group_every_function_failed_gets_the_fallback():
    values = {"a": [N, N, 1.0, 0.0], "b": [N, N, None, None]}
    rewards, out, failed = _combine(values, group_size=2, with_failed=True)
    assert rewards == [-1.0, -1.0, 1.0, 0.0] and failed == [True, True, False, False] and out == [False] * 4


def test_a_function_that_failed_some_of_a_group_gives_those_samples_the_fallback():
    values = {"good": [1.0, 0.0, 1.0, 0.0], "flaky": [0.5, N, N, N]}
    rewards, out, failed = _combine(values, group_size=2, with_failed=True)
    # group 0: flaky worked on sample 0, failed sample 1 (fallback); group 1: flaky failed it all (left out)
    assert rewards == [1.5, -1.0, 2.0, 0.0] and failed == [False, True, False, False]


def test_with_no_reward_function_the_environment_alone_scores():
    # reward.functions: [] with rollout.env set: every sample is scored, by its environment's reward
    rewards, out, _ = combine({}, {}, [0.25, 0.25, 1.0, 0.0], -1.0, 2)
    assert rewards == [0.25, 0.25, 1.0, 0.0] and out == [False] * 4


def test_weights_apply_to_what_applies():
    rewards, _ = _combine({"a": [1.0, 1.0], "b": [2.0, 0.0]}, group_size=2, weights={"a": 0.5, "b": 2.0})
    assert rewards == [4.5, 0.5]


USER = textwrap.dedent("""
    def judge_even(prompt, completion, **kw):          # per sample, None allowed
        return None if completion == "?" else float(completion == "even")

    def trl_style(completions, **kw):                  # batched, None allowed
        return [None if c == "?" else 1.0 for c in completions]

    def _private(prompt, completion, **kw):
        return 0.0
    renamed = _private
""")


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("nulls") / "nullable.py"
    path.write_text(USER)
    return str(path)


def test_python_functions_of_both_forms_may_return_none(user_file):
    cfg = RewardConfig(functions=[f"{user_file}:judge_even", f"{user_file}:trl_style"], num_procs=1)
    with RewardScorer(cfg) as scorer:
        res = scorer.score(["p"] * 4, ["even", "?", "odd", "even"], [{}] * 4, group_size=4)
    assert _same(res.rewards, [2.0, N, 1.0, 2.0]) and res.unscorable == 1 and res.errors == 0
    assert res.functions["judge_even"].unscorable == 1 and res.functions["trl_style"].unscorable == 1
    assert res.functions["judge_even"].values == [1.0, 0.0, 1.0]


def test_names_by_kind_and_reward_names(user_file, tmp_path):
    assert default_name("gsm8k") == "gsm8k"
    assert default_name("model:/models/my-rm/") == "my-rm"
    assert default_name("http://verifier.local:8080/v1/score") == "verifier.local_v1_score"
    assert default_name("https://example.com") == "example.com"
    with RewardScorer(RewardConfig(functions=[f"{user_file}:renamed", "format"], num_procs=1)) as scorer:
        assert list(scorer.names.values()) == ["_private", "format"]  # a Python function's __name__
    with RewardScorer(RewardConfig(functions=[f"{user_file}:renamed", "format"], names=["mine", "fmt"],
                                   num_procs=1)) as scorer:
        assert scorer.score(["p"], ["1"], [{}]).functions.keys() == {"mine", "fmt"}
    with pytest.raises(ValueError, match="share the metric name 'format'.*reward.names"):
        RewardScorer(RewardConfig(functions=["format", "exact_match"], names=["format", "format"]))
    with RewardScorer(RewardConfig(functions=["format"], names=["my format!"])) as scorer:
        assert scorer.names == {"format": "my_format_"}  # what TensorBoard accepts in a tag
    with pytest.raises(ValueError, match="reward.functions lists format more than once"):
        RewardScorer(RewardConfig(functions=["format", "format"]))
    with pytest.raises(ValueError, match="reward.names has 1 entries but reward.functions has 2"):
        RewardScorer(RewardConfig(functions=["format", "exact_match"], names=["x"]))


def test_kinds_and_what_is_checked_at_start(tmp_path):
    specs = ("gsm8k", "a.py:f", "model:x", "http://h/p", "https://h", "nope", "model:a.py:f", "http://h/a.py:f")
    assert [getattr(kind_for(s), "name", None) for s in specs] == \
        ["python", "python", "model", "http", "http", None, "model", "http"]
    assert "no host" in spec_problems("http:///verify")[0]
    assert "no such directory" in model_dir_problems(str(tmp_path / "missing"))[0]
    (tmp_path / "lm").mkdir()
    (tmp_path / "lm" / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"]}')
    problems = " ".join(model_dir_problems(str(tmp_path / "lm")))
    assert "not a ...ForSequenceClassification" in problems and "no tokenizer" in problems
    # issue 36: a causal LM's config says nothing true about labels (transformers' default of 2): not said
    assert "label" not in problems.replace("num_labels=1)", "")
    (tmp_path / "lm" / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"], "id2label": {"0": "a", "1": "b"}}')
    assert "2 labels" not in " ".join(model_dir_problems(str(tmp_path / "lm")))
    (tmp_path / "cls").mkdir()  # a classifier with 2 labels: that is wrong, and said
    (tmp_path / "cls" / "config.json").write_text('{"architectures": ["Qwen2ForSequenceClassification"], '
                                                  '"id2label": {"0": "a", "1": "b"}}')
    (tmp_path / "cls" / "tokenizer.json").write_text("{}")
    assert model_dir_problems(str(tmp_path / "cls")) == [
        f"reward model {str(tmp_path / 'cls')!r} (reward.functions entry model:{tmp_path / 'cls'}) has 2 labels; "
        "a reward model has one (num_labels=1): its single logit is the reward"]
    with pytest.raises(ValueError, match="model:PATH.*http"):
        RewardScorer(RewardConfig(functions=["nope"]))


def test_a_reward_model_call_cut_by_a_broken_connection_goes_again_once_ray_moved_it(monkeypatch, capsys):
    """Ray's retries of a reward model's call can run out, each refused at once, before Ray has marked its
    host dead: the call goes again once the actor left its place (waited for, bounded), bounded as before;
    an actor that died for good is an error at once."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError

    sent, moved = [], []

    def wait_for(ref, actor, what, timeout_s, probe=None):
        if ref == 1:  # the first call: its connection broke
            try:
                raise ActorUnavailableError("The actor is temporarily unavailable: connection refused", None)
            except ActorUnavailableError as e:
                raise ActorFailed(actor, what, died=True, detail=str(e)) from e
        return {"values": [0.5], "truncated": 0, "seconds": 0.1, "pid": 7}

    monkeypatch.setattr(model, "wait_for", wait_for)
    monkeypatch.setattr(model, "wait_moved", lambda handle, wait_s: moved.append((handle, wait_s)))
    runner = model.RewardModels(["model:/rm"])

    def call():
        sent.append(1)
        return len(sent)

    assert runner._wait("model:/rm", "handle", call, 1)["values"] == [0.5]
    assert len(sent) == 2 and moved == [("handle", model.HOST_VERDICT_WAIT_S)]
    assert "reward model /rm: its connection broke while scoring 1 completions; the call goes again" \
        in capsys.readouterr().out

    def dead(ref, actor, what, timeout_s):
        try:
            raise ActorDiedError()
        except ActorDiedError as e:
            raise ActorFailed(actor, what, died=True, detail="died") from e

    monkeypatch.setattr(model, "wait_for", dead)
    with pytest.raises(ActorFailed, match="reward model /rm"):
        runner._wait("model:/rm", "handle", call, 1)
    assert len(sent) == 3  # not sent again
