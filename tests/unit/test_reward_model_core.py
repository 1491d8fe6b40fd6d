"""actors/rewards/model_actor.py's scoring core without Ray: what it feeds the reward model equals what
transformers' own forward reads (plain strings, chat messages, multi-turn, truncation, batching).
The same through a real Ray actor, with a trained model, is tests/e2e/test_reward_model.py."""
from __future__ import annotations

import pytest
import torch

from actors.config import RewardConfig
from actors.rewards.model_actor import RewardModelScorer
from cluster.models.tinychat import TinyChatSpec, build_bpe_tokenizer
from cluster.models.tinymodel import build_tokenizer


def _random_reward_model(path, tokenizer, pad_token_id):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=(len(tokenizer) + 63) // 64 * 64, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, num_labels=1,
                         max_position_embeddings=128, pad_token_id=pad_token_id)
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def char_rm(tmp_path_factory):
    tok = build_tokenizer()
    return _random_reward_model(tmp_path_factory.mktemp("rm") / "char-rm", tok, tok.pad_token_id)


@pytest.fixture(scope="module")
def chat_rm(tmp_path_factory):  # a tokenizer without a pad token, a config without pad_token_id (as TRL meets them)
    tok = build_bpe_tokenizer(TinyChatSpec(pad_token=False))
    return _random_reward_model(tmp_path_factory.mktemp("rm") / "chat-rm", tok, None)


def _transformers_reward(path, text: str, special_tokens: bool, keep_last: int | None = None) -> float:
    """What a user gets from transformers alone: tokenizer, then the model's single logit."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok(text, add_special_tokens=special_tokens, return_tensors="pt")["input_ids"]
    if keep_last:
        ids = ids[:, -keep_last:]
    with torch.no_grad():
        return model(input_ids=ids).logits[0, 0].item()


def test_plain_strings_are_concatenated(char_rm):
    prompts, completions = ["12+34="] * 3 + ["7+8="], ["46", "4", "46+46=92+1", ""]
    scorer = RewardModelScorer(char_rm, RewardConfig(model_batch_size=3))
    values, truncated = scorer.score(prompts, completions)
    assert truncated == 0
    for p, c, v in zip(prompts, completions, values):
        assert v == pytest.approx(_transformers_reward(char_rm, p + c, special_tokens=True), abs=1e-5)


def test_chat_messages_get_the_completion_as_the_assistant_turn(chat_rm):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_rm)
    prompt = [{"role": "system", "content": "Solve."}, {"role": "user", "content": "Tom has 3 apples and buys 4."}]
    completions = ["He has 7 apples. #### 7", "#### 8", "I do not know"]
    scorer = RewardModelScorer(chat_rm, RewardConfig(model_batch_size=2))
    assert scorer.model.config.pad_token_id == tok.eos_token_id  # no pad: EOS pads, as TRL sets it
    values, _ = scorer.score([prompt] * 3, completions)
    for c, v in zip(completions, values):
        text = tok.apply_chat_template(prompt + [{"role": "assistant", "content": c}], tokenize=False)
        assert text.endswith(f"<|im_start|>assistant\n{c}<|im_end|>\n")
        assert v == pytest.approx(_transformers_reward(chat_rm, text, special_tokens=False), abs=1e-5)
    # a multi-turn trajectory is scored on its whole conversation
    talk = prompt + [{"role": "assistant", "content": "calc(3+4)"}, {"role": "tool", "content": "7"},
                     {"role": "assistant", "content": "#### 7"}]
    [v], _ = scorer.score([prompt], ["#### 7"], [talk])
    text = tok.apply_chat_template(talk, tokenize=False)
    assert v == pytest.approx(_transformers_reward(chat_rm, text, special_tokens=False), abs=1e-5)


def test_overlong_inputs_keep_their_last_tokens_and_are_counted(char_rm):
    scorer = RewardModelScorer(char_rm, RewardConfig(model_max_len=6))
    values, truncated = scorer.score(["123+456="] * 2 + ["1+2="], ["579", "5790", "3"])
    assert truncated == 2
    for text, v in zip(["123+456=579", "123+456=5790", "1+2=3"], values):
        assert v == pytest.approx(_transformers_reward(char_rm, text, special_tokens=True, keep_last=6), abs=1e-5)
    assert RewardModelScorer(char_rm, RewardConfig(model_max_len=4096)).max_len == 128  # the model's positions


def test_chat_prompts_need_a_chat_template(char_rm):
    with pytest.raises(ValueError, match="has no chat template, but the prompts are chat messages"):
        RewardModelScorer(char_rm, RewardConfig()).score([[{"role": "user", "content": "hi"}]], ["x"])
