"""cluster/run/completions.py: which completions are logged, what a row holds, how `raygrpo show` prints them.
The rollouts are real Completion / Trajectory objects; no engine runs."""
import json
import math

import pytest

from actors.completions import Completion, PromptRollout
from actors.multiturn.trajectories import MultiTurnRollout, Trajectory
from cluster.data.dataset import Example
from cluster.run import completions


def test_pick_spans_the_prompts_first():
    assert completions.pick(3, 4, 4) == [(0, 0), (1, 0), (2, 0), (0, 1)]
    assert completions.pick(1, 2, 5) == [(0, 0), (0, 1)]  # never more than there are
    assert completions.pick(0, 4, 4) == []


def single_turn_round():
    live = [(Example([{"role": "user", "content": f"q{g}"}], {"answer": "#### 7"}),
             PromptRollout([1], [1], [Completion([5] * (j + 1), [-0.1] * (j + 1), f"c{g}{j}", "stop" if j else "length")
                                      for j in range(2)], weight_version=0)) for g in range(2)]
    return live


def test_sample_rows_carry_prompt_completion_scores_advantage_and_finish_reason():
    live = single_turn_round()
    rewards = [1.0, 0.0, 0.5, 0.5]
    per_function = {"gsm8k": [1.0, 0.0, float("nan"), 0.5], "format": [0.0, 0.0, 0.5, 0.0]}
    rows = completions.sample_rows(live, rewards, per_function, [0.7, -0.7, 0.0, 0.0], 2, 3)
    assert [(r["prompt_index"], r["sample"]) for r in rows] == [(0, 0), (1, 0), (0, 1)]
    first = rows[0]
    assert first == {"prompt_index": 0, "sample": 0, "prompt": [{"role": "user", "content": "q0"}], "completion": "c00",
                     "reward": 1.0, "rewards": {"gsm8k": 1.0, "format": 0.0}, "advantage": 0.7,
                     "finish_reason": "length", "num_tokens": 1}
    assert rows[1]["rewards"]["gsm8k"] is None  # the call failed (NaN): null, shown as "error"
    assert "reward 0.500 (gsm8k error, format 0.500)" in completions.headline(rows[1])


def multi_turn_round():
    t = Trajectory(prompt_ids=[1], token_ids=[5, 6, 2, 9, 9, 7, 2], loss_mask=[1, 1, 1, 0, 0, 1, 1],
                   messages=[{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "calc(2+3)"},
                             {"role": "tool", "content": "5"}, {"role": "assistant", "content": "#### 5"}],
                   text="#### 5", finish_reason="stop", turns=2, tool_calls=1, env_reward=0.5)
    return [(Example("2+3?", {}), MultiTurnRollout([t, t], weight_version=0))]


def test_multi_turn_rows_hold_the_transcript_and_show_prints_it_with_roles(tmp_path):
    rows = completions.sample_rows(multi_turn_round(), [1.5, 1.5], {}, [0.0, 0.0], 2, 1)
    assert rows[0]["messages"][2] == {"role": "tool", "content": "5"} and rows[0]["turns"] == 2
    assert rows[0]["num_tokens"] == 5 and rows[0]["env_reward"] == 0.5  # model tokens only
    completions.write_rows(tmp_path, 3, rows)
    lines = []
    completions.show(tmp_path, None, None, out=lines.append)
    text = "\n".join(lines)
    assert "step 3, 1 of 1 logged completion(s)" in text
    assert "[user] 2+3?\n  [assistant] calc(2+3)\n  [tool] 5\n  [assistant] #### 5" in text
    assert "environment 0.500" in text and "2 turn(s)" in text


def test_show_picks_the_step_and_the_count_and_says_what_is_there(tmp_path):
    live = single_turn_round()
    for step in (1, 2, 3, 5):
        completions.write_rows(tmp_path, step, completions.sample_rows(live, [1, 0, 1, 0], {"f": [1, 0, 1, 0]},
                                                                       [1, -1, 1, -1], 2, 4))
    with open(tmp_path / completions.COMPLETIONS_FILE, "a") as f:
        f.write('{"step": 6, "prompt')  # a line cut short by a crash is skipped
    lines = []
    completions.show(tmp_path, 2, 2, out=lines.append)
    text = "\n".join(lines)
    assert "step 2, 2 of 4 logged completion(s) (steps logged: 1-3, 5)" in text
    assert text.count("--- step 2,") == 2 and "prompt:\n  [user] q0\ncompletion:\n  c00" in text
    with pytest.raises(FileNotFoundError, match="no completions of step 4; logged steps: 1-3, 5"):
        completions.show(tmp_path, 4, None, out=lines.append)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no completions.jsonl there"):
        completions.show(tmp_path / "empty", None, None)
    with pytest.raises(FileNotFoundError, match="no such directory"):
        completions.show(tmp_path / "nope", None, None)


def test_markdown_and_table_name_every_reward_function():
    rows = [{"step": 1, **r} for r in completions.sample_rows(single_turn_round(), [1, 0, 1, 0],
                                                              {"gsm8k": [1, 0, 1, 0]}, [1, -1, 1, -1], 2, 2)]
    md = completions.markdown(rows)
    assert "**prompt 1, sample 1**: reward 1.000 (gsm8k 1.000)" in md and "    [completion] c00" in md
    columns, data = completions.table(rows)
    assert columns == ["step", "prompt", "completion", "reward", "gsm8k", "advantage", "finish_reason", "num_tokens"]
    assert data[0][:5] == [1, "[user] q0", "c00", 1.0, 1.0]
    json.dumps(data)  # plain values only
    assert not any(isinstance(v, float) and math.isnan(v) for row in data for v in row)
