"""A tiny offline *chat* model: Qwen2 weights + a byte-level BPE tokenizer + a ChatML template.

What a user's HF chat model (Qwen2.5-Instruct and the like) brings, at test size, built with
no hub access: a byte-level BPE tokenizer trained here with `tokenizers` (Qwen2's
pre-tokenizer split, so words merge into multi-character tokens and digits stay single), the
special tokens `<|endoftext|>` (pad, as in Qwen2.5), `<|im_start|>`, `<|im_end|>` (EOS), a
ChatML chat template, and a generation_config.json whose `eos_token_id` lists both
`<|im_end|>` and `<|endoftext|>` (as Qwen2.5-Instruct's does).

The template is prefix-preserving: rendering `messages[:k]` without a generation prompt is a
prefix of rendering `messages[:k+1]`, so a conversation can be extended token by token.

Deterministic and cached like `build_tiny_model`: the same spec gives the same bytes, and a
directory built from the same spec is reused.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from cluster.config import load_config
from cluster.data.dataset import load_run_data, load_tokenizer
from cluster.models.tasks import chat_rows, tool_rows
from cluster.models.tinymodel import TinyModelSpec, is_cached, write_model_dir
from cluster.models.warmstart import WarmStartSpec, warm_start
from cluster.models.wordproblems import conversational_rows, write_jsonl

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2

# ChatML, as Qwen2.5 renders it minus tools and its default system prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2's pre-tokenizer split (GPT-4 style, with single digits).
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclasses.dataclass(frozen=True)
class TinyChatSpec:
    model: TinyModelSpec = TinyModelSpec()
    vocab_size: int = 1024  # an upper bound: the small corpus may run out of merges before it
    corpus_size: int = 2000  # word problems the tokenizer is trained on
    pad_token: bool = True  # False: no pad token at all (as some base models ship)
    # "recipes": also the chat and tools recipes' conversations (cluster/models/tasks.py), so their
    # numbers and calc(...) calls tokenize the way the recipes ask them
    corpus: str = "wordproblems"


def _training_corpus(n: int, corpus: str = "wordproblems") -> list[str]:
    """What the BPE merges are learned from: rendered word-problem conversations and their
    worked answers, plus the characters arithmetic prompts use (and with corpus="recipes", the
    demo recipes' conversations)."""
    texts = []
    for row in conversational_rows(n, seed=0):
        for m in row["prompt"]:
            texts.append(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n")
        texts.append(f"{IM_START}assistant\n{row['answer']}{IM_END}\n")
    texts.append("0123456789 +-*/=()?.,:;!'\"#<>[]_ " * 4)
    if corpus == "recipes":
        for row in tool_rows(n, seed=99, tool_fraction=1.0) + chat_rows(n, seed=99):
            for m in row["prompt"] + row.get("demo", [{"role": "assistant", "content": row["answer"]}]):
                texts.append(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n")
    return texts


def build_bpe_tokenizer(spec: TinyChatSpec):
    """A byte-level BPE `PreTrainedTokenizerFast` trained on `_training_corpus`, with ChatML."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size, min_frequency=2, show_progress=False,
        special_tokens=list(SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_training_corpus(spec.corpus_size, spec.corpus), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT if spec.pad_token else None,
        model_max_length=spec.model.max_position_embeddings, clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_chat_model(out_dir: str | os.PathLike, spec: TinyChatSpec = TinyChatSpec()) -> Path:
    """Write (or reuse) a chat model directory for `spec`; returns its path."""
    from transformers import GenerationConfig

    out = Path(out_dir)
    fields = dataclasses.asdict(spec)
    if fields["corpus"] == "wordproblems":  # models cached before the field existed stay valid
        del fields["corpus"]
    spec_json = json.dumps({"chat": fields}, sort_keys=True)
    if is_cached(out, spec_json):
        return out
    tokenizer = build_bpe_tokenizer(spec)
    eos, endoftext = tokenizer.convert_tokens_to_ids([IM_END, ENDOFTEXT])
    pad = endoftext if spec.pad_token else None
    generation_config = GenerationConfig(bos_token_id=endoftext, eos_token_id=[eos, endoftext], pad_token_id=pad)
    write_model_dir(out, spec.model, tokenizer, spec_json, eos_token_id=eos, bos_token_id=endoftext,
                    pad_token_id=pad, generation_config=generation_config)
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m cluster.models.tinychat`: build the chat model, write the word-problem JSONL files that
    examples/chat_cpu.yaml trains on, and warm-start a copy of the model on them (supervised, cached),
    so that GRPO starts from a model that is sometimes right."""
    p = argparse.ArgumentParser(prog="python -m cluster.models.tinychat", description=main.__doc__)
    p.add_argument("--model-dir", default=".cache/chat/tiny-chat-qwen2", help="where the base model goes (cached)")
    p.add_argument("--data-dir", default="examples/data", help="where wordproblems_{train,eval}.jsonl go")
    p.add_argument("--train-rows", type=int, default=256)
    p.add_argument("--eval-rows", type=int, default=64)
    p.add_argument("--warm-start-steps", type=int, default=80, help="supervised steps (0: none); the result is "
                   "written next to the model as <model-dir>-warm<steps>")
    args = p.parse_args(argv)
    model = build_tiny_chat_model(args.model_dir)
    train = write_jsonl(Path(args.data_dir) / "wordproblems_train.jsonl", conversational_rows(args.train_rows, seed=1))
    held = write_jsonl(Path(args.data_dir) / "wordproblems_eval.jsonl", conversational_rows(args.eval_rows, seed=2))
    print(f"model: {model}\ntrain data: {train}\neval data: {held}")
    if args.warm_start_steps:
        # the training prompts rendered exactly as a run renders them (chat template, token ids)
        cfg = load_config(None, [f"model.path={model}", f"data.train={train}"])
        examples = load_run_data(cfg, load_tokenizer(str(model))).train
        spec = WarmStartSpec(steps=args.warm_start_steps, batch_size=32, lr=1e-3, seed=0)
        warm = warm_start(model, f"{args.model_dir}-warm{args.warm_start_steps}", examples, spec)
        print(f"warm-started model: {warm}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
