"""Multi-turn rollouts on a real vLLM engine (Ray actor) with the tiny chat model (ChatML, EOS <|im_end|>).

One engine for the module: the engine pool's chat-model engine (tests/e2e/engine_pool.py CHAT_CONFIG), which
starts with this module's environment, a scripted test env (scripted_env.py): a random tiny model never calls a
tool by itself, so the env answers the first turn with a `tool` message and the second with a `user` message
whatever the model said, and ends the episode after the third turn. Examples with a `mode` field make their
environment raise, hang or break the contract instead.

Multi-turn through the CLI: test_smollm2.py's ZeRO-2 run (the built-in calculator, a reward reading the
whole conversation, --log-level INFO) and test_external_cluster.py's run by address (a user's environment from a file).
"""
from __future__ import annotations

import math

import pytest
import torch
from engine_pool import CHAT_CONFIG
from multiturn_loss import learner_loss_and_grads, model_tokens_only_loss_and_grads

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
    """One call: two healthy prompts, three whose environment fails at its second step and one whose environment
    fails at its reset."""
    fields = [{"answer": "7"}, {"mode": "raise"}, {"mode": "hang"}, {"mode": "garbage"}, {"answer": "7"},
              {"mode": "broken"}]
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
    # a reset that raised (issue 30 case 5): its trajectory ends before any turn, nothing sampled, the error named
    # as the console says it (the driver's line and halt on it: tests/unit/test_driver_seam_halts.py)
    for t in rollouts[5].trajectories:
        assert t.finish_reason == "env_error" and t.env_error == "reset: RuntimeError: no sandbox available", t.env_error
        assert t.turns == 0 and t.token_ids == [] and t.logprobs == []
    healthy = rollouts[0].trajectories + rollouts[4].trajectories
    assert all(t.turns == 3 and t.env_error is None for t in healthy)
    errors = sum(t.env_error is not None for r in rollouts for t in r.trajectories)
    assert errors == 4 * G


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
