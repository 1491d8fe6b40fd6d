"""A decoder model's shape and parameter count, read from its config.json (no weights loaded).

Parameters of a Llama/Qwen-style decoder with hidden h, L layers, query width q = heads x head_dim,
key/value width k = kv_heads x head_dim, MLP width I, vocabulary V:

    P = V h (embedding) + L [h q + 2 h k + q h (attention) + 3 h I (gated MLP) + 2 h (norms)]
        + h (final norm) + V h (untied output head) + L (q + 2 k) (Qwen2's q/k/v biases)
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Biased q/k/v projections: Qwen2 (and Qwen2.5) set them without an `attention_bias` key.
_QKV_BIAS_TYPES = ("qwen2",)


class ShapeError(ValueError):
    pass


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool = False

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_params(self) -> int:
        h, q, k, i = self.hidden, self.q_width, self.kv_width, self.intermediate
        bias = (q + 2 * k) if self.qkv_bias else 0
        return h * q + 2 * h * k + q * h + bias + 3 * h * i + 2 * h

    def params(self) -> int:
        embed = self.vocab * self.hidden
        return embed * (1 if self.tied else 2) + self.layers * self.layer_params() + self.hidden

    def largest_leaf_params(self) -> int:
        """The largest single module's parameters (the embedding or one MLP matrix): what ZeRO-3 gathers at
        once, as DeepSpeed's estimate counts it (largest_layer_params)."""
        return max(self.vocab * self.hidden, self.hidden * self.intermediate, self.hidden * self.q_width)

    def activation_elems_per_token(self) -> int:
        """Elements one token keeps through one layer's forward (for its backward, or vLLM's profile run):
        4h + 2q + 2k + 4I (plan/memory.py's docstring)."""
        return 4 * self.hidden + 2 * self.q_width + 2 * self.kv_width + 4 * self.intermediate

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of every layer for one token: 2 L k bytes-per-element."""
        return 2 * self.layers * self.kv_width * dtype_bytes


def shape_from_config(cfg: dict, name: str = "") -> ModelShape:
    """The shape from a HF config.json's dict. A key it lacks is an error naming it."""
    text = cfg.get("text_config", cfg)  # multimodal configs keep the decoder's under text_config
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                           "vocab_size") if k not in text]
    if missing:
        raise ShapeError(f"config.json of {name or 'the model'} lacks {', '.join(missing)}: raygrpo plan reads a "
                         "Llama/Qwen-style decoder's shape from it")
    if text.get("num_experts") or text.get("num_local_experts"):
        raise ShapeError(f"{name or 'the model'} is a mixture of experts: raygrpo plan models dense decoders only")
    heads = int(text["num_attention_heads"])
    hidden = int(text["hidden_size"])
    return ModelShape(
        name=name or text.get("_name_or_path", "") or text.get("model_type", "model"),
        hidden=hidden, layers=int(text["num_hidden_layers"]), heads=heads,
        kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=int(text.get("head_dim") or hidden // heads), intermediate=int(text["intermediate_size"]),
        vocab=int(text["vocab_size"]), tied=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        qkv_bias=bool(text.get("attention_bias", text.get("model_type") in _QKV_BIAS_TYPES)))


def read_shape(model_dir: str | Path) -> ModelShape:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ShapeError(f"model.path {str(model_dir)!r} has no config.json: point model.path at a HF model directory, "
                         f"or name a published model ({', '.join(PUBLISHED)})")
    return shape_from_config(json.loads(path.read_text()), Path(model_dir).name)


def model_shape(path_or_name: str) -> ModelShape:
    """model.path's config.json, else a published model by name (for planning before the weights are here)."""
    key = Path(path_or_name).name if path_or_name else ""
    if path_or_name and (Path(path_or_name) / "config.json").is_file():
        return read_shape(path_or_name)
    if key in PUBLISHED:
        return PUBLISHED[key]
    raise ShapeError(f"model.path {path_or_name!r} is not a model directory and not a published model raygrpo plan "
                     f"knows ({', '.join(PUBLISHED)}): set model.path=DIR (config.json is enough) or model.path=NAME")


def _published(name, hidden, layers, heads, kv, intermediate, vocab, tied, head_dim=0, bias=False) -> ModelShape:
    return ModelShape(name, hidden, layers, heads, kv, head_dim or hidden // heads, intermediate, vocab, tied, bias)


# The shapes in these models' published config.json files (Hugging Face hub), so a plan needs no download.
PUBLISHED: dict[str, ModelShape] = {s.name: s for s in (
    _published("SmolLM2-135M-Instruct", 576, 30, 9, 3, 1536, 49152, True),
    _published("Qwen2.5-0.5B-Instruct", 896, 24, 14, 2, 4864, 151936, True, bias=True),
    _published("Qwen2.5-1.5B-Instruct", 1536, 28, 12, 2, 8960, 151936, True, bias=True),
    _published("Qwen2.5-7B", 3584, 28, 28, 4, 18944, 152064, False, bias=True),
    _published("Qwen2.5-Math-7B", 3584, 28, 28, 4, 18944, 152064, False, bias=True),
    _published("Qwen3-4B", 2560, 36, 32, 8, 9728, 151936, True, head_dim=128),
    _published("Llama-3.1-8B-Instruct", 4096, 32, 32, 8, 14336, 128256, False),
)}
