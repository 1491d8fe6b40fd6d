import pytest

from cluster.config import RunConfig
from cluster.data.dataset import (
    DataError,
    Example,
    PromptStream,
    RunData,
    arithmetic_examples,
    load_jsonl,
    load_splits,
    required_columns,
    reward_column_problem,
    unknown_roles_note,
)


def test_jsonl_fields_and_malformed_line_named(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": 3}\nnot json\n')
    with pytest.raises(DataError) as e:
        load_jsonl(p)
    assert f"{p}:3" in str(e.value) and f"{p}:4" in str(e.value)
    p.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (ex,) = load_jsonl(p)
    assert ex.prompt == "1+1=" and ex.fields == {"answer": "2"}


def test_arithmetic_task_answers():
    ex = arithmetic_examples("addition", 2)
    assert len(ex) == 90 * 90
    assert all(int(e.prompt[:2]) + int(e.prompt[3:5]) == int(e.fields["answer"]) for e in ex)
    sub = arithmetic_examples("subtraction", 1)
    assert all(int(e.fields["answer"]) >= 0 for e in sub)
    with pytest.raises(DataError, match="built-in tasks"):
        arithmetic_examples("poetry", 2)


def test_heldout_split_is_disjoint_and_seeded():
    train, held = load_splits("task:addition", "", 50, 2, seed=3)
    assert len(held) == 50 and not {e.prompt for e in held} & {e.prompt for e in train}
    assert load_splits("task:addition", "", 50, 2, seed=3)[1] == held


def test_stream_resumes_exactly_across_epochs():
    examples = arithmetic_examples("addition", 1)  # 100
    a = PromptStream(examples, seed=1)
    first = a.take(70)
    state = a.state()
    rest = a.take(80)  # crosses into epoch 1
    b = PromptStream(examples, seed=1)
    b.load_state(state)
    assert b.take(80) == rest
    assert len({e.prompt for e in first + rest[:30]}) == 100  # one epoch = each example once


def test_prompts_in_flight_at_a_checkpoint_are_handed_out_first_after_a_resume():
    """trainer.mode=pipeline: a checkpoint records the prompts taken and not trained on; a stream loaded
    from it hands those out first, in that order, then goes on from its position (as a run that never
    stopped would have); a checkpoint taken before they are all out again records the rest."""
    examples = arithmetic_examples("addition", 1)
    a = PromptStream(examples, seed=1)
    taken = a.take(6)
    assert a.state() == {"epoch": 0, "index": 6}  # no key when nothing is in flight: sync and async unchanged
    state = a.state(in_flight=[taken[4], taken[1]])
    assert state == {"epoch": 0, "index": 6, "in_flight": [examples.index(taken[4]), examples.index(taken[1])]}
    b = PromptStream(examples, seed=1)
    b.load_state(state)
    assert b.take(1) == [taken[4]]
    assert b.state() == {"epoch": 0, "index": 6, "in_flight": [examples.index(taken[1])]}
    assert b.take(3) == [taken[1], *a.take(2)]
    assert b.state() == a.state()
    b.load_state({"epoch": 0, "index": 0})
    assert b.take(1) == PromptStream(examples, seed=1).take(1)  # a plain position clears what was in flight
    with pytest.raises(DataError, match=r"names prompts \[100\] in flight, but the training set has 100"):
        b.load_state({"epoch": 0, "index": 6, "in_flight": [3, 100]})


def test_an_unknown_message_role_is_warned_about_with_where_it_is():
    """Issue 30 case 11: a message role "wizard" was accepted without a word."""
    rows = [Example([{"role": "user", "content": "hi"}], where="d.jsonl:1"),
            Example([{"role": "wizard", "content": "x"}, {"role": "user", "content": "hi"}], where="d.jsonl:2"),
            Example("plain", where="d.jsonl:3")]
    note = unknown_roles_note(rows, "train")
    assert note.startswith("warning: 1 train prompt(s)") and "'wizard'" in note and "d.jsonl:2" in note
    assert unknown_roles_note(rows[:1] + rows[2:], "train") is None


def test_a_user_reward_functions_required_columns_are_read_from_its_source(tmp_path):
    """Issue 30 case 11: each reward's required columns are checked at load (the driver runs no user code)."""
    f = tmp_path / "rewards.py"
    f.write_text("import sys\nsys.exit(3)  # never run by the check\n"
                 "def per_sample(prompt, completion, difficulty, answer=None, *, topic, _num_tokens, **kw):\n"
                 "    return 0.0\n"
                 "def batched(prompts, completions, completion_ids, source, **kw):\n"
                 "    return [0.0] * len(prompts)\n"
                 "alias = per_sample\n")
    assert required_columns(f"{f}:per_sample") == ["difficulty", "topic"]
    assert required_columns(f"{f}:batched") == ["source"]
    assert required_columns(f"{f}:alias") == [] and required_columns(f"{tmp_path}/gone.py:f") == []

    def run(functions, rows, heldout=()):
        cfg = RunConfig()
        cfg.reward.functions = functions
        data = RunData([Example("p", r, where=f"d.jsonl:{i + 1}") for i, r in enumerate(rows)],
                       [Example("p", r) for r in heldout], [])
        return reward_column_problem(cfg, data)

    problem = run([f"{f}:per_sample"], [{"difficulty": 1, "topic": "a"}, {"difficulty": 2}])
    assert problem.startswith(f"reward function {f}:per_sample takes 'topic' (a parameter without a default), "
                              "a column 1 of 2 train rows lack; e.g. d.jsonl:2: columns difficulty")
    assert run([f"{f}:per_sample"], [{"difficulty": 1, "topic": "a"}]) is None
    assert "takes 'source'" in run([f"{f}:batched"], [{"answer": "1"}], heldout=[{"answer": "1"}])
    # held-out rows matter only where the evaluation scores with the user function (no answer checker)
    assert "1 of 1 eval rows lack" in run([f"{f}:batched"], [{"source": "x"}], heldout=[{"answer": "1"}])
    assert run(["exact_match", f"{f}:batched"], [{"source": "x", "answer": "1"}], heldout=[{"answer": "1"}]) is None
