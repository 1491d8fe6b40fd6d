"""What is checked about the model directory before any actor starts.

An engine or a learner rank that meets a bad model fails minutes later, inside its own process,
with a message in terms of its own internals (a pydantic traceback, "Target modules not found",
a state_dict size mismatch). These checks read the model's files on the driver instead (JSON
and safetensors headers; the tokenizer where one is loaded anyway) and name the config key:

- `weight_problems`: weights exist and every safetensors header parses and fits its file;
- `position_problems`: rollout.max_model_len against the positions the model has (as vLLM derives them:
  config.json's length keys, the tokenizer's model_max_length, the RoPE factor);
- `lora_target_problems`: learner.lora_target_modules against the model's module names;
- `packing_problems`: learner.pack_sequences against the model's kind (config.json model_type);
- `tokenizer_problems`: the tokenizer has a vocabulary and encodes a test prompt to tokens;
- `eos_warning`: no end-of-sequence token anywhere, so completions cannot end early;
- `checkpoint_model_problems`: a checkpoint to resume was trained on this model's architecture (and on its
  weights, where the resumed run takes some from model.path).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

from learner.config import PACKABLE_MODEL_TYPES
from learner.hf_dir import base_weights_problem

# The config.json keys vLLM reads a model's maximum length from (the smallest one found wins).
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                 "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
# RoPE types whose `factor` vLLM does not apply to the length (their length is already scaled, or theirs).
UNSCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")
# What a checkpoint's model must share with model.path to be loaded into it.
ARCHITECTURE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "intermediate_size", "vocab_size", "head_dim", "tie_word_embeddings")
TEST_PROMPT = "What is 2 + 3? Answer: 5"


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


# --------------------------------------------------------------------------- weights
def weight_files(model_dir: Path) -> tuple[list[Path], str]:
    """(the safetensors files of a model dir, a problem reading its index or "")."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as e:
            return [], f"{index} is not a readable safetensors index ({e})"
        return [model_dir / n for n in names], ""
    return sorted(model_dir.glob("*.safetensors")), ""


def weight_problems(model_dir: Path) -> list[str]:
    """The model dir must hold weights, and every safetensors file's header must parse and fit the
    file (a truncated download fails here, not minutes later inside an engine)."""
    files, problem = weight_files(model_dir)
    if problem:
        return [f"model.path: {problem}"]
    if not files:
        if any(model_dir.glob("pytorch_model*.bin")):
            return []  # pickled weights: no cheap header to check; transformers reads them
        return [f"model.path {str(model_dir)!r} holds no weights (no *.safetensors or pytorch_model*.bin): "
                "copy the model's weight files there"]
    return [f"model.path: {p}" for f in files if (p := _safetensors_header(f)[1])]


def _safetensors_header(f: Path) -> tuple[dict, str]:
    """(the file's header, "") or ({}, what is wrong with the file)."""
    if not f.is_file():
        return {}, f"{f} is missing (listed in the index)"
    size = f.stat().st_size
    try:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > size - 8:
                return {}, f"{f} is truncated: its header says {n} bytes of metadata, the file has {size}"
            header = json.loads(fh.read(n))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        return {}, f"{f} is not a valid safetensors file ({type(e).__name__}: {e})"
    if 8 + n + end > size:
        return {}, f"{f} is truncated: {size} bytes, its header needs {8 + n + end}"
    return header, ""


def module_names(model_dir: Path) -> set[str] | None:
    """The names of the model's modules that hold weights, from the safetensors headers (no model
    is built); None when they cannot be read that way (pickled weights)."""
    files, problem = weight_files(model_dir)
    if problem or not files:
        return None
    names = set()
    for f in files:
        header, problem = _safetensors_header(f)
        if problem:
            return None
        names |= {k.rsplit(".", 1)[0] for k in header if k != "__metadata__" and "." in k}
    if read_json(model_dir / "config.json").get("tie_word_embeddings"):
        names.add("lm_head")  # tied: saved once, as the embedding, but a module of its own
    return names


# --------------------------------------------------------------------------- config-time checks
def model_problems(cfg) -> list[str]:
    """Checks of a RunConfig against its model's files (model.path already known to be a model dir)."""
    model_dir = Path(cfg.model.path)
    return position_problems(model_dir, cfg.rollout.max_model_len) + (
        lora_target_problems(model_dir, cfg.learner.lora_target_modules) if cfg.learner.lora else []) + (
        packing_problems(model_dir) if cfg.learner.pack_sequences else [])


def packing_problems(model_dir: Path) -> list[str]:
    """learner.pack_sequences on a model whose attention mask is not built from restarting position ids
    (learner/packing.py): its packed sequences would attend to each other."""
    kind = read_json(model_dir / "config.json").get("model_type", "")
    if kind in PACKABLE_MODEL_TYPES:
        return []
    return [f"learner.pack_sequences is not supported for model_type {kind!r} ({model_dir}/config.json): packed "
            f"sequences are kept apart only by models that build their attention mask from restarting position ids "
            f"({', '.join(PACKABLE_MODEL_TYPES)}); set learner.pack_sequences=false"]


def max_positions(model_dir: Path) -> tuple[int, str] | None:
    """(the longest sequence the model takes, where that comes from), as vLLM derives it; None if unknown."""
    config = read_json(model_dir / "config.json")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    found = [(text[k], f"{k}={text[k]} in config.json") for k in POSITION_KEYS if isinstance(text.get(k), int) and text[k] > 0]
    if not found:
        return None
    tok = read_json(model_dir / "tokenizer_config.json").get("model_max_length")
    if isinstance(tok, int) and 0 < tok < 10**9:  # (transformers writes ~1e30 for "no limit")
        found.append((tok, f"model_max_length={tok} in tokenizer_config.json"))
    length, key = min(found)
    rope = text.get("rope_scaling") or text.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if isinstance(rope, dict) and isinstance(rope.get("factor"), (int, float)) and rope_type not in UNSCALED_ROPE \
            and "gemma3" not in str(text.get("model_type", "")):
        return int(length * rope["factor"]), f"{key}, x rope factor {rope['factor']:g}"
    return length, key


def position_problems(model_dir: Path, max_model_len: int) -> list[str]:
    known = max_positions(model_dir)
    if known is None or max_model_len <= known[0]:
        return []
    return [f"rollout.max_model_len ({max_model_len}) is longer than the model takes ({known[1]} of "
            f"{model_dir}, as vLLM reads it): set rollout.max_model_len <= {known[0]}"]


def lora_target_problems(model_dir: Path, targets: list[str]) -> list[str]:
    """peft matches a target name against module names by suffix (`q_proj` matches `...self_attn.q_proj`)."""
    names = module_names(model_dir)
    if names is None or not targets or "all-linear" in targets:
        return []
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if len(missing) < len(targets):
        return []  # peft adapts what matches; a partial list is the model's shape (e.g. no gate_proj)
    layer = sorted({n.rsplit(".", 1)[-1] for n in names if ".layers." in n or ".h." in n or ".blocks." in n})
    return [f"learner.lora_target_modules {targets} match no module of the model in {model_dir}; its layers' "
            f"modules are: {', '.join(layer) or ', '.join(sorted(names)[:20])}"]


# --------------------------------------------------------------------------- the tokenizer
def tokenizer_problems(tok, model_path: str) -> list[str]:
    """A tokenizer that loaded but cannot turn text into tokens (e.g. a model dir without tokenizer files,
    for which transformers builds an empty one from config.json): every prompt would be 0 tokens."""
    regular = len(tok) - len(set(tok.all_special_ids))
    if regular <= 0:
        return [f"model.path {model_path}: its tokenizer has no vocabulary ({len(tok)} token(s), all special): are "
                "the tokenizer files (tokenizer.json / tokenizer_config.json / vocab.json / tokenizer.model) there? "
                "Copy them from the model the weights came from"]
    ids = tok(TEST_PROMPT, add_special_tokens=False)["input_ids"]
    if not ids:
        return [f"model.path {model_path}: its tokenizer encodes the test prompt {TEST_PROMPT!r} to 0 tokens; "
                "check its tokenizer files"]
    return []


def declared_eos(model_path: str) -> list:
    """The end-of-sequence tokens the model's files declare: the tokenizer's eos_token
    (tokenizer_config.json, special_tokens_map.json) and the eos_token_id of generation_config.json, or
    of config.json where there is no generation_config.json (vLLM's fallback). Read from the files, not
    from the loaded tokenizer: transformers 5 invents an `<|endoftext|>` for a tokenizer that declares
    none, a token the model never saw in training."""
    d = Path(model_path)
    found = [read_json(d / f).get("eos_token") for f in ("tokenizer_config.json", "special_tokens_map.json")]
    gen = d / "generation_config.json"
    found.append(read_json(gen if gen.is_file() else d / "config.json").get("eos_token_id"))
    return [x for x in found if x not in (None, "", [])]


def eos_warning(model_path: str, rollout) -> str | None:
    """The run's completions cannot end before rollout.max_new_tokens: the model declares no EOS and
    rollout.stop is empty. A warning, not an error: fixed-length completions may be the point (and
    rollout.min_new_tokens = rollout.max_new_tokens says so: then nothing is said)."""
    if declared_eos(model_path) or rollout.stop or rollout.min_new_tokens >= rollout.max_new_tokens:
        return None
    return (f"warning: the model declares no end-of-sequence token (no eos_token in its tokenizer files, no "
            f"eos_token_id in generation_config.json / config.json) and rollout.stop is empty, so every "
            f"completion runs to rollout.max_new_tokens={rollout.max_new_tokens} and the model cannot learn to "
            f"stop. Set eos_token in {Path(model_path) / 'tokenizer_config.json'}, or rollout.stop")


# --------------------------------------------------------------------------- resuming
def checkpoint_model_problems(ckpt: Path, model_path: str, hf_meta_dir: str, lora: bool = False,
                              beta: float = 0.0) -> list[str]:
    """A checkpoint saves its model's config (hf_meta_dir); resuming it into another architecture fails
    deep inside DeepSpeed (a state_dict size mismatch). Compare the two configs first. And where the resumed
    run takes weights from model.path besides the checkpoint (`lora`: the frozen base, which a LoRA checkpoint
    leaves out; `beta` > 0: the reference model), they must be those the run trained from, which the
    checkpoint's fingerprint of them says (learner/hf_dir.py): other weights there would resume quietly into a
    run that never was."""
    theirs = read_json(ckpt / hf_meta_dir / "config.json")
    ours = read_json(Path(model_path) / "config.json")
    if not theirs or not ours:
        return []  # an older checkpoint without its config: the learner's load decides
    diffs = [f"{k} {theirs.get(k)!r} vs {ours.get(k)!r}" for k in ARCHITECTURE_KEYS if theirs.get(k) != ours.get(k)]
    if diffs:
        return [f"checkpoint.resume: {ckpt} was trained from another model than model.path {model_path} "
                f"(checkpoint vs model.path: {', '.join(diffs)}). Point model.path at the model that run trained, or "
                "checkpoint.resume at a checkpoint of this model"]
    taken = [what for what, takes in (("the frozen base of its LoRA adapter (learner.lora_rank)", lora),
                                      ("the reference model of the KL term (algo.beta > 0)", beta > 0)) if takes]
    changed = base_weights_problem(ckpt, hf_meta_dir, model_path) if taken else None
    if changed is None:
        return []
    return [f"checkpoint.resume: {ckpt} cannot be resumed from model.path as it is: {changed}, and the resumed run "
            f"takes {' and '.join(taken)} from there. Point model.path at the model that run trained from, or "
            "start afresh (checkpoint.resume=none)"]
