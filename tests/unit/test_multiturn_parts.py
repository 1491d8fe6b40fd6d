"""Multi-turn pieces without an engine: the template check and suffixes, rewards on trajectories,
the loss mask's token counts, the config's checks."""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from actors.config import RewardConfig, RolloutConfig
from actors.multiturn.trajectories import ChatTokens, MultiTurnRollout, TemplateError, Trajectory, run_trajectories
from actors.rewards.scorer import RewardScorer
from cluster.config import ConfigError, load_config
from cluster.data.dataset import Example, load_tokenizer
from cluster.data.render import conversation, multiturn_format
from cluster.driver.batch import Batch, CollectStats, ScoredGroup, model_tokens
from cluster.driver.startup import check_multiturn
from cluster.models.tinychat import TinyChatSpec, build_bpe_tokenizer
from learner.batch import TrainBatch


@pytest.fixture(scope="module")
def tokenizer():
    return build_bpe_tokenizer(TinyChatSpec(corpus_size=200))


def test_env_suffix_keeps_the_turn_separator(tokenizer):
    chat = ChatTokens(tokenizer)
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "calc(1+1)"}]
    new = [{"role": "tool", "content": "2"}]
    ended = chat.env_suffix(conv, new, turn_ended=True)
    assert tokenizer.decode(ended) == "\n<|im_start|>tool\n2<|im_end|>\n<|im_start|>assistant\n"
    cut = chat.env_suffix(conv, new, turn_ended=False)
    assert cut == [tokenizer.eos_token_id] + ended


def test_a_flooding_tool_reply_is_tokenized_without_transformers_warning(tokenizer, caplog):
    """A tool reply longer than the tokenizer's model_max_length: its tokens counted quietly. raygrpo says the
    overflow itself (env_overflows); transformers' "Token indices sequence length" warning reached the console."""
    chat = ChatTokens(tokenizer)
    flood = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x " * (tokenizer.model_max_length + 100)}]
    with caplog.at_level("WARNING"):
        assert len(chat.ids(flood, add_generation_prompt=True)) > tokenizer.model_max_length
    assert not [r for r in caplog.records if "Token indices sequence length" in r.getMessage()], caplog.text


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer):
    # Like templates that strip earlier assistant turns' reasoning: only the LAST assistant turn keeps its text.
    original = tokenizer.chat_template
    tokenizer.chat_template = (
        "{%- for m in messages %}{%- if m['role'] == 'assistant' and not loop.last %}"
        "{{- '<|im_start|>assistant\\n<|im_end|>\\n' }}{%- else %}"
        "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    try:
        with pytest.raises(TemplateError, match="not prefix-preserving"):
            ChatTokens(tokenizer)
    finally:
        tokenizer.chat_template = original


def test_rewards_see_the_conversation_and_add_the_env_reward(tmp_path):
    path = tmp_path / "r.py"
    path.write_text("def turns_reward(prompt, completion, _messages, _turns, _num_tokens):\n"
                    "    assert _messages[-1]['content'] == completion\n"
                    "    return 10 * _turns + _num_tokens\n")
    traj = Trajectory(prompt_ids=[1], token_ids=[5, 6, 7, 8], loss_mask=[1, 0, 0, 1], logprobs=[-1.0, -2.0],
                      messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                                {"role": "tool", "content": "t"}, {"role": "assistant", "content": "final"}],
                      text="final", finish_reason="stop", turns=2, env_reward=0.5)
    with RewardScorer(RewardConfig(functions=[f"{path}:turns_reward"], num_procs=1)) as scorer:
        res = scorer.score(["q"], [traj], [{}])
    assert res.errors == 0 and res.rewards == [20 + 2 + 0.5]
    assert traj.model_logprobs_full()[0] == -1.0 and traj.model_logprobs_full()[3] == -2.0


def test_loss_mask_counts_model_tokens_only():
    nan = float("nan")
    batch = TrainBatch(prompt_ids=[[1, 2], [3]], completion_ids=[[4, 5, 6, 7], [8, 9]], advantages=[1.0, -1.0],
                       behavior_logp=[[-1.0, nan, nan, -2.0], [-1.0, -1.0]], loss_mask=[[1, 0, 0, 1], [1, 1]])
    batch.validate()
    assert batch.num_completion_tokens() == 4 and batch.max_trained_tokens() == 2
    mb = batch.micro_batches(2)[0]
    assert mb.mask.tolist() == [[1, 0, 0, 1], [1, 1, 0, 0]]
    assert mb.behavior_logp.isfinite().all()  # environment positions zeroed, never NaN downstream
    assert batch.shard(1, 2).loss_mask == [[1, 1]]
    bad = TrainBatch(prompt_ids=[[1]], completion_ids=[[4, 5]], advantages=[1.0], behavior_logp=[[-1.0, -1.0]],
                     loss_mask=[[1]])
    with pytest.raises(ValueError, match="loss_mask"):
        bad.validate()


def test_config_checks_the_environment(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.path=/nonexistent", "rollout.env=nope", "rollout.max_turns=0"])
    text = str(e.value)
    assert "rollout.env 'nope'" in text and "rollout.max_turns must be >= 1" in text
    with pytest.raises(ConfigError, match="needs rollout.env"):
        load_config(None, ["model.path=/nonexistent", "rollout.max_turns=3"])


class _FakeLLM:
    """Stands in for the engine: each request samples `length` tokens [7, 8, ...] and then the eos (or is
    cut at max_tokens), with log-prob -1 per token; records the contexts it was given."""

    def __init__(self, eos, ends=True, length=3):
        self.eos, self.ends, self.length, self.prompts = eos, ends, length, []

    def __call__(self, requests):
        self.calls = getattr(self, "calls", 0) + 1
        outs = []
        for context, max_tokens, _ in requests:
            self.prompts.append(list(context))
            ids = [7 + i for i in range(self.length)] + ([self.eos] if self.ends else [])
            cut = len(ids) > max_tokens
            ids = ids[:max_tokens]
            outs.append((ids, [-1.0] * len(ids), "length" if cut or not self.ends else "stop"))
        return outs


class _FakeEnvs:
    """An in-process EnvPool: `done_after` steps, each answered with one tool message."""

    def __init__(self, done_after=99):
        self.done_after, self.steps = done_after, {}

    def run(self, calls):
        out = []
        for key, method, _ in calls:
            if method == "step":
                self.steps[key] = self.steps.get(key, 0) + 1
                out.append((True, {"messages": [{"role": "tool", "content": "5"}],
                                   "done": self.steps[key] >= self.done_after, "reward": 0.0}))
            else:
                out.append((True, [] if method == "open" else None))
        return out


def _run(tokenizer, llm, envs, **cfg):
    counter = itertools.count()
    config = RolloutConfig(env="calculator", **cfg)
    return run_trajectories(llm, ChatTokens(tokenizer), envs, config, [[{"role": "user", "content": "q"}]], [{}], 2,
                            [0], 0, lambda: next(counter))[0].trajectories


@pytest.mark.parametrize("case", ["max_turns", "stop", "length", "max_model_len"])
def test_finish_reasons_and_budget(tokenizer, case):
    eos = tokenizer.eos_token_id
    if case == "max_turns":
        llm = _FakeLLM(eos)
        trajs = _run(tokenizer, llm, _FakeEnvs(), max_turns=3, max_new_tokens=8)
        assert all(t.turns == 3 and t.tool_calls == 3 and t.finish_reason == "max_turns" for t in trajs)
        assert llm.calls == 3 and len(llm.prompts) == 6  # one engine call per turn, for every trajectory
    elif case == "stop":
        trajs = _run(tokenizer, _FakeLLM(eos), _FakeEnvs(done_after=1), max_turns=3, max_new_tokens=8)
        assert all(t.turns == 1 and t.finish_reason == "stop" and t.env_tokens == 0 for t in trajs)
        assert trajs[0].token_ids == [7, 8, 9, eos] and trajs[0].loss_mask == [1, 1, 1, 1]
    elif case == "length":  # cut turns go to the environment; the template closes them (env tokens)
        trajs = _run(tokenizer, _FakeLLM(eos, ends=False, length=8), _FakeEnvs(done_after=2), max_turns=3,
                     max_new_tokens=4)
        t = trajs[0]
        assert t.turns == 2 and t.finish_reason == "length"
        assert t.token_ids[:5] == [7, 8, 9, 10, eos] and t.loss_mask[:5] == [1, 1, 1, 1, 0]
    else:
        llm = _FakeLLM(eos, length=10)
        trajs = _run(tokenizer, llm, _FakeEnvs(), max_turns=50, max_new_tokens=16, max_model_len=64)
        for t in trajs:
            assert t.finish_reason == "max_model_len" and len(t.prompt_ids) + len(t.token_ids) <= 64
        assert all(len(p) < 64 for p in llm.prompts)  # never a request without room for a token


def test_collect_reads_trajectories_like_completions():
    def traj(prompt, ids, mask, error=None):
        return Trajectory(prompt_ids=prompt, token_ids=ids, loss_mask=mask, logprobs=[-0.5] * sum(mask), turns=2,
                          tool_calls=1, env_tokens=len(mask) - sum(mask), env_error=error, text="t",
                          finish_reason="env_error" if error else "stop")

    ro = MultiTurnRollout([traj([1, 2], [5, 6, 7], [1, 0, 1]), traj([1, 2, 3], [5], [1], error="step: boom")],
                          weight_version=3, env_s=0.25)
    stats = CollectStats()
    stats.add_trajectories([ro])
    assert model_tokens(ro) == 3
    m = stats.metrics()
    assert m["turns_mean"] == 2 and m["tool_calls_mean"] == 1 and m["env_errors"] == 1
    assert m["env_s"] == 0.25 and m["env_tokens_mean"] == 0.5
    batch = Batch.from_groups([ScoredGroup(Example("q", {}), ro, [1.0, 0.0])], {}, stats, version_if_empty=0,
                              advantage_estimator="grpo")
    assert batch.prompt_ids == [[1, 2], [1, 2, 3]] and batch.completion_ids == [[5, 6, 7], [5]]
    assert batch.loss_mask == [[1, 0, 1], [1]] and batch.behavior_logp[0][0] == -0.5
    assert "turns_mean" not in CollectStats().metrics()  # single-turn runs: the logger writes NaN


def test_an_environment_that_fails_at_reset_ends_its_trajectory_before_any_turn(tokenizer):
    class FailingOpen(_FakeEnvs):
        def run(self, calls):
            return [(False, "TypeError: bad field") if m == "open" else (True, None) for _, m, _ in calls]

    llm = _FakeLLM(tokenizer.eos_token_id)
    trajs = _run(tokenizer, llm, FailingOpen(), max_turns=3, max_new_tokens=8)
    assert all(t.finish_reason == "env_error" and t.turns == 0 and t.token_ids == [] for t in trajs)
    assert "bad field" in trajs[0].env_error and llm.prompts == []  # nothing was sent to the engine


def test_the_driver_refuses_a_bad_template_or_env_before_any_actor(tokenizer, tmp_path):
    model = tmp_path / "model"
    tokenizer.save_pretrained(model)
    (model / "config.json").write_text("{}")
    save_file({"w": torch.zeros(1)}, str(model / "model.safetensors"))  # the config check wants readable weights
    calculator = load_config(None, [f"model.path={model}", "rollout.env=calculator"])
    check_multiturn(calculator, load_tokenizer(str(model)))  # fine as it is
    original = tokenizer.chat_template
    tokenizer.chat_template = "{%- for m in messages %}{{- m['content'] }}{%- endfor %}"  # no end-of-turn token
    tokenizer.save_pretrained(model)
    tokenizer.chat_template = original
    with pytest.raises(ConfigError, match="not prefix-preserving"):
        check_multiturn(calculator, load_tokenizer(str(model)))
    bad_env = tmp_path / "env.py"
    bad_env.write_text("raise ImportError('missing dependency')\n")
    with pytest.raises(ConfigError, match="missing dependency"):
        check_multiturn(load_config(None, [f"model.path={model}", f"rollout.env={bad_env}:Env"]),
                        load_tokenizer(str(model)))


def test_the_calculator_example_config_is_valid():
    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "examples" / "calculator.yaml", validate_paths=False)  # model and data are the user's
    assert cfg.rollout.env == "calculator" and cfg.rollout.max_turns > 1


def test_multiturn_conversations_open_like_single_turn_prompts(tokenizer):
    """data.system_prompt and data.chat_template_kwargs reach multi-turn rollouts too."""
    cfg = load_config(None, ["rollout.env=calculator", "data.system_prompt=Use calc.",
                             "data.chat_template_kwargs={enable_thinking: false}"], validate_paths=False)
    fmt = multiturn_format(cfg)
    assert conversation("2+3?", fmt) == [{"role": "system", "content": "Use calc."}, {"role": "user", "content": "2+3?"}]
    own = [{"role": "system", "content": "Mine."}, {"role": "user", "content": "q"}]
    assert conversation(own, fmt) == own  # the data's own system message wins
    chat = ChatTokens(tokenizer, fmt.chat_template_kwargs)
    assert chat.template_kwargs == {"enable_thinking": False}
    assert chat.ids(own, True) == tokenizer.apply_chat_template(own, add_generation_prompt=True, enable_thinking=False,
                                                                tokenize=True, return_dict=False)
