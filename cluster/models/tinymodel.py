"""Build a small Qwen2 model directory offline: tokenizer + config + random weights.

No hub access anywhere: the tokenizer is made with the `tokenizers` library (one token per
character, so arithmetic prompts tokenize predictably), wrapped as `PreTrainedTokenizerFast`,
and the weights are drawn from a seeded generator. The same spec and seed always give the
same bytes, and a directory built before with the same spec is reused (cached).

vLLM, transformers and DeepSpeed all load what this writes (tests/e2e/test_tinymodel_loads.py).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import string
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

SPEC_FILE = "raygrpo_tiny_spec.json"
PAD, EOS = "<pad>", "<eos>"
# Characters the built-in tasks and the tests use; anything else maps to <unk>.
ALPHABET = string.digits + string.ascii_letters + " +-*/=()?.,:;!'\"#<>[]_\n"


@dataclasses.dataclass(frozen=True)
class TinyModelSpec:
    """Size knobs. head_dim = hidden_size / num_heads must be >= 32 (vLLM CPU attention)."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = True
    seed: int = 0

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.hidden_size // self.num_heads < 32:
            raise ValueError(
                f"head_dim {self.hidden_size // self.num_heads} < 32: vLLM's CPU attention does not support it; "
                "use fewer heads or a larger hidden_size"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")


def build_tokenizer():
    """A character-level tokenizer: every character of ALPHABET is one token."""
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, EOS: 1, "<unk>": 2}
    for ch in ALPHABET:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token="<unk>", model_max_length=4096
    )


def _padded_vocab(n: int, multiple: int = 64) -> int:
    return (n + multiple - 1) // multiple * multiple


def is_cached(out: Path, spec_json: str) -> bool:
    """True if `out` was built from exactly `spec_json`; raises if it holds something else."""
    if (out / SPEC_FILE).exists() and (out / SPEC_FILE).read_text() == spec_json:
        return True
    if out.exists():
        raise FileExistsError(
            f"{out} exists but was not built from this spec; remove it or choose another directory"
        )
    return False


def build_tiny_model(out_dir: str | os.PathLike, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write (or reuse) a model directory for `spec`; returns its path."""
    out = Path(out_dir)
    spec_json = json.dumps(dataclasses.asdict(spec), sort_keys=True)
    if is_cached(out, spec_json):
        return out
    tokenizer = build_tokenizer()
    write_model_dir(out, spec, tokenizer, spec_json, eos_token_id=tokenizer.eos_token_id,
                    bos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return out


def write_model_dir(out: Path, spec: TinyModelSpec, tokenizer, spec_json: str, *, eos_token_id,
                    bos_token_id=None, pad_token_id=None, generation_config=None) -> None:
    """Random-weight Qwen2 of `spec` + `tokenizer` (+ an optional GenerationConfig) into `out`.

    Written to a temporary sibling and renamed, so a crash never leaves a half-built model
    that a later call would take for a cached one.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=_padded_vocab(len(tokenizer)),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    if generation_config is not None:
        model.generation_config = generation_config
    save_model_dir(out, model, tokenizer, spec_json)


def save_model_dir(out: Path, model, tokenizer, spec_json: str) -> None:
    """`model`, `tokenizer` and the SPEC_FILE `is_cached` reads into `out`, written to a temporary
    sibling and renamed: a crash never leaves a half-built model to be taken for a cached one."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / SPEC_FILE).write_text(spec_json)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def num_parameters(model_dir: str | os.PathLike) -> int:
    """Parameter count read from the safetensors header (tied embeddings counted once)."""
    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
