"""Multi-turn rollouts on a real vLLM engine (Ray actor) with the tiny chat model (ChatML, EOS <|im_end|>).

One engine for the module: the engine pool's chat-model engine (tests/e2e/engine_pool.py CHAT_CONFIG), which
starts with this module's environment, a scripted test env (scripted_env.py): a random tiny model never calls a
tool by itself, so the env answers the first turn with a `tool` message and the second with a `user` message
whatever the model said, and ends the episode after the third turn. Examples with a `mode` field make their
environment raise, hang or break the contract instead.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from engine_pool import CHAT_CONFIG
from multiturn_loss import learner_loss_and_grads, model_tokens_only_loss_and_grads

from cluster.run.metrics import read_metrics
from learner.batch import TrainBatch

pytestmark = pytest.mark.timeout(900)

QUESTION = [{"role": "system", "content": "Solve it."}, {"role": "user", "content": "Tom has 3 apples and gets 4 more."}]
MAX_NEW = 10
G = 2


@pytest.fixture(scope="module")
def engine(engine_pool, tiny_chat_model_dir):
    """The pool's chat-model engine (its scripted environment: 3 turns, each env call cut at 3 s, 2 env processes),
    MAX_NEW tokens a turn (a call-time setting, put back by the pool at the module's end)."""
    assert CHAT_CONFIG.max_turns == 3 and CHAT_CONFIG.env_timeout_s == 3.0 and CHAT_CONFIG.env.endswith(":Scripted")
    with engine_pool.lease(tiny_chat_model_dir, config=CHAT_CONFIG) as (worker,):
        engine_pool.configure(worker, max_new_tokens=MAX_NEW)
        yield worker


@pytest.fixture(scope="module")
def rollouts(ray_cluster, engine):
    """One call: two healthy prompts and three whose environment fails at its second step."""
    fields = [{"answer": "7"}, {"mode": "raise"}, {"mode": "hang"}, {"mode": "garbage"}, {"answer": "7"}]
    return ray_cluster.get(engine.generate_multiturn.remote([QUESTION] * len(fields), fields, G,
                                                            seeds=list(range(len(fields)))))


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_chat_model_dir))


def _runs(mask):
    """(start, end, is_model) of each maximal run of equal loss-mask values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, bool(mask[start])))
            start = i
    return out


def test_three_turn_trajectories_are_token_exact(rollouts, tokenizer):
    healthy = rollouts[0].trajectories + rollouts[4].trajectories
    for t in healthy:
        assert t.turns == 3 and t.env_error is None and t.tool_calls == 1
        assert t.finish_reason in ("stop", "length")  # env done after turn 3 (length: that turn was cut)
        assert t.env_reward == pytest.approx(1.25)
        assert [m["role"] for m in t.messages] == ["system", "user", "assistant", "tool", "assistant", "user",
                                                    "assistant"]
        assert t.prompt_ids == tokenizer.encode(
            tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
        # The trajectory decodes to what apply_chat_template renders for the final conversation, up to the
        # template's closing of the last turn (which nobody sampled: "\n" after <|im_end|>, or both if cut).
        text = tokenizer.decode(t.prompt_ids + t.token_ids, skip_special_tokens=False)
        rendered = tokenizer.apply_chat_template(t.messages, tokenize=False)
        closing = "\n" if t.turn_ended else "<|im_end|>\n"
        assert rendered == text + closing
        # ids = sampled ids (runs of mask 1, one per turn; their log-probs came with them) and template
        # suffixes (runs of mask 0), each suffix exactly the template's tokens for the text between turns.
        runs = _runs(t.loss_mask)
        model_runs = [(s, e) for s, e, m in runs if m]
        env_runs = [(s, e) for s, e, m in runs if not m]
        assert len(model_runs) == 3 and len(env_runs) == 2 and runs[0][2]
        assert sum(t.loss_mask) == len(t.logprobs) and t.env_tokens == len(t.token_ids) - len(t.logprobs)
        assistant = [m["content"] for m in t.messages if m["role"] == "assistant"]
        for (s, e), content in zip(model_runs, assistant):
            assert tokenizer.decode(t.token_ids[s:e], skip_special_tokens=False).removesuffix("<|im_end|>") == content
        between = ["\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n",
                   "\n<|im_start|>user\nThanks. Now the answer?<|im_end|>\n<|im_start|>assistant\n"]
        for (s, e), (_, sampled_end), text_between in zip(env_runs, model_runs, between):
            cut = t.token_ids[sampled_end - 1] != tokenizer.eos_token_id  # the template closes a cut turn
            expected = ("<|im_end|>" if cut else "") + text_between
            assert t.token_ids[s:e] == tokenizer.encode(expected, add_special_tokens=False)


def test_behaviour_logprobs_line_up_with_model_tokens(ray_cluster, engine, rollouts):
    """vLLM's prompt log-probs of the whole trajectory equal the per-turn sampled log-probs at model positions."""
    trajs = rollouts[0].trajectories + rollouts[4].trajectories
    full = ray_cluster.get(engine.prompt_logprobs.remote([t.prompt_ids + t.token_ids for t in trajs]))
    for t, lp in zip(trajs, full):
        at = lp[len(t.prompt_ids) - 1:]  # lp[j] scores token j+1 of the sequence
        assert len(at) == len(t.token_ids)
        model = [v for v, m in zip(at, t.loss_mask) if m]
        assert max(abs(a - b) for a, b in zip(model, t.logprobs)) <= 1e-4
        spread = t.model_logprobs_full()
        assert all(math.isnan(v) for v, m in zip(spread, t.loss_mask) if not m)


def test_a_failing_environment_ends_only_its_trajectory(rollouts):
    for index, what in ((1, "the environment broke"), (2, "timed out"), (3, "expected a dict")):
        for t in rollouts[index].trajectories:
            assert t.finish_reason == "env_error" and what in t.env_error, t.env_error
            assert t.turns == 2  # its first step answered; the second failed and ended it
            assert t.loss_mask[-1] == 1  # nothing appended after the failed step
    healthy = rollouts[0].trajectories + rollouts[4].trajectories
    assert all(t.turns == 3 and t.env_error is None for t in healthy)
    errors = sum(t.env_error is not None for r in rollouts for t in r.trajectories)
    assert errors == 3 * G


def test_env_tokens_are_out_of_the_learner_loss(rollouts, tiny_chat_model_dir):
    """The learner's loss and gradients on real trajectories ignore every value at environment positions,
    and equal a loss taken over the model tokens alone."""
    trajs = rollouts[0].trajectories + rollouts[4].trajectories

    def batch(env_value):
        beh = [[v if m else env_value for v, m in zip(t.model_logprobs_full(), t.loss_mask)] for t in trajs]
        ref = [[v - 0.1 if m else -env_value for v, m in zip(t.model_logprobs_full(), t.loss_mask)] for t in trajs]
        return TrainBatch(prompt_ids=[t.prompt_ids for t in trajs], completion_ids=[t.token_ids for t in trajs],
                          advantages=[1.0, -1.0, 0.5, -0.5], behavior_logp=beh, ref_logp=ref,
                          loss_mask=[t.loss_mask for t in trajs], pad_id=0)

    clean, garbage = batch(float("nan")), batch(1e6)
    mb = clean.micro_batches(8)[0]
    for r, t in enumerate(trajs):
        assert mb.mask[r, :len(t.token_ids)].tolist() == [float(m) for m in t.loss_mask]
    assert clean.num_completion_tokens() == sum(len(t.logprobs) for t in trajs)
    loss_a, grads_a = learner_loss_and_grads(tiny_chat_model_dir, clean)
    loss_b, grads_b = learner_loss_and_grads(tiny_chat_model_dir, garbage)
    assert math.isfinite(loss_a) and loss_a == loss_b
    assert all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)
    # Independently: the same loss from the model positions alone (no mask plumbing involved).
    loss_c, grads_c = model_tokens_only_loss_and_grads(tiny_chat_model_dir, clean)
    assert loss_c == pytest.approx(loss_a, abs=1e-6)
    assert max((grads_a[k] - grads_c[k]).abs().max().item() for k in grads_a) <= 1e-5


NUDGED_CALCULATOR = textwrap.dedent('''
    from actors.multiturn.envs import CalculatorEnv

    class NudgedCalculator(CalculatorEnv):
        """The built-in calculator, except that a first turn without a calc() call is answered with a
        user message asking for one (a random tiny model never writes calc() by itself)."""

        def step(self, text):
            out = super().step(text)
            self.turn = getattr(self, "turn", 0) + 1
            if self.turn == 1 and out["done"]:
                return {"messages": [{"role": "user", "content": "Use calc(expression) to check."}], "done": False}
            return out
''')


def test_cli_run_with_the_calculator_env_logs_multi_turn_metrics(tiny_chat_model_dir, tmp_path):
    """`raygrpo train` for 3 steps with a calculator environment. Honest note: turns_mean > 1 here
    comes from the env's nudge after the first turn, not from the model calling the tool.
    With --log-level INFO: the third-party lines that the default level keeps out of the console
    (test_console_and_completions.py) are back in it."""
    env_file = tmp_path / "nudged_calculator.py"
    env_file.write_text(NUDGED_CALCULATOR)
    reward_file = tmp_path / "conversation_reward.py"  # sees the whole conversation; varies, so advantages do
    reward_file.write_text(
        "def conversation_reward(prompt, completion, _messages, _turns, _num_tokens):\n"
        "    assert _messages[-1] == {'role': 'assistant', 'content': completion} and _turns >= 2\n"
        "    assert [m['role'] for m in _messages[:3]] == ['user', 'assistant', 'user']\n"
        "    return len(completion) / 10\n")
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Tom has {a} apples and gets {b} more. How many?",
                                        "answer": str(a + b)}) + "\n" for a in range(1, 5) for b in range(1, 5)))
    cfg = tmp_path / "calc.yaml"
    cfg.write_text(textwrap.dedent(f"""
        model: {{path: {tiny_chat_model_dir}}}
        data: {{train: {data}, num_eval: 0}}
        trainer: {{steps: 3, prompts_per_step: 2, group_size: 2, run_dir: {tmp_path / 'run'}, actor_timeout_s: 300}}
        rollout: {{env: "{env_file}:NudgedCalculator", max_turns: 3, max_new_tokens: 8, max_model_len: 192,
                  cpu_kv_cache_mb: 64}}
        reward: {{functions: [exact_match, "{reward_file}:conversation_reward"]}}
        learner: {{lr: 1.0e-4, micro_batch_size: 4}}
        metrics: {{tensorboard: false}}
    """))
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "cluster.cli", "train", str(cfg), "--log-level", "INFO"],
                         capture_output=True, text=True, cwd=root, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Successfully reset prefix cache" in out.stdout + out.stderr  # vLLM's INFO line, each weight sync
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["turns_mean"] > 1 and r["env_errors"] == 0 and r["env_tokens_mean"] > 0 and r["env_s"] >= 0
        assert r["tool_calls_mean"] == 0.0  # the random model never writes calc(); the nudge is a user message
        assert r["reward_errors"] == 0 and r["grad_norm"] > 0 and math.isfinite(r["loss"])
