"""The offline chat tokenizer behaves like a real HF chat tokenizer (BPE, special tokens, ChatML)."""
from __future__ import annotations

import pytest

from cluster.models.tinychat import ENDOFTEXT, IM_END, IM_START, TinyChatSpec, build_bpe_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_bpe_tokenizer(TinyChatSpec())


CONVERSATION = [
    {"role": "system", "content": "Solve the problem."},
    {"role": "user", "content": "Tom has 3 apples and gets 12 more. How many apples does Tom have now?"},
    {"role": "assistant", "content": "Tom has 3 + 12 = 15 apples.\n#### 15"},
    {"role": "user", "content": "And with 2 more?"},
]


def test_special_tokens_are_single_ids_and_eos_is_im_end(tokenizer):
    assert tokenizer.eos_token == IM_END and tokenizer.pad_token == ENDOFTEXT
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    for token in (ENDOFTEXT, IM_START, IM_END):
        assert len(tokenizer.encode(token)) == 1


def test_bpe_merges_words_and_splits_digits(tokenizer):
    text = "Tom has 12 apples."
    tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode(text))
    assert len(tokens) < len(text)  # multi-character tokens
    assert "1" in tokens and "2" in tokens  # digits one by one, as Qwen2 splits them
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_decode_skips_special_tokens(tokenizer):
    ids = tokenizer.encode("Tom has 15 apples.\n#### 15" + IM_END)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Tom has 15 apples.\n#### 15"


def test_chatml_rendering_and_generation_prompt(tokenizer):
    text = tokenizer.apply_chat_template(CONVERSATION[:2], add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nSolve the problem.<|im_end|>\n"
        f"<|im_start|>user\n{CONVERSATION[1]['content']}<|im_end|>\n<|im_start|>assistant\n"
    )


def test_template_is_prefix_preserving(tokenizer):
    for k in range(1, len(CONVERSATION)):
        shorter = tokenizer.apply_chat_template(CONVERSATION[:k], tokenize=False)
        longer = tokenizer.apply_chat_template(CONVERSATION[: k + 1], tokenize=False)
        assert longer.startswith(shorter)
        ids_short = tokenizer.encode(shorter)
        assert tokenizer.encode(longer)[: len(ids_short)] == ids_short


def test_no_pad_token_variant():
    tok = build_bpe_tokenizer(TinyChatSpec(pad_token=False))
    assert tok.pad_token is None and tok.eos_token == IM_END
