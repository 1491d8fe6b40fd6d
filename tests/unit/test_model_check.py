"""cluster/data/model_check.py: the model directory checked before any actor starts (issue 30 cases 4, 7, 9)."""
from __future__ import annotations

import json
import shutil

import pytest

from cluster.config import ConfigError, load_config
from cluster.data.dataset import DataError, load_tokenizer
from cluster.data.model_check import checkpoint_model_problems, eos_warning, max_positions, module_names


def copy_model(src, dst, **config_changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(cfg | config_changes))
    return dst


def test_max_model_len_is_checked_against_the_models_positions(tiny_model_dir, tmp_path):
    assert max_positions(tiny_model_dir) == (512, "max_position_embeddings=512 in config.json")
    with pytest.raises(ConfigError, match=r"rollout.max_model_len \(4096\) is longer than the model takes "
                                          r"\(max_position_embeddings=512 in config.json of .*\): set rollout.max_model_len <= 512"):
        load_config(None, [f"model.path={tiny_model_dir}", "rollout.max_model_len=4096"])
    load_config(None, [f"model.path={tiny_model_dir}", "rollout.max_model_len=512"])  # at the limit: fine
    scaled = copy_model(tiny_model_dir, tmp_path / "rope", rope_scaling={"rope_type": "linear", "factor": 4.0})
    assert max_positions(scaled) == (2048, "max_position_embeddings=512 in config.json, x rope factor 4")
    short = copy_model(tiny_model_dir, tmp_path / "short")
    tc = json.loads((short / "tokenizer_config.json").read_text())
    (short / "tokenizer_config.json").write_text(json.dumps(tc | {"model_max_length": 256}))
    assert max_positions(short) == (256, "model_max_length=256 in tokenizer_config.json")


def test_lora_targets_are_checked_against_the_models_modules(tiny_model_dir):
    names = module_names(tiny_model_dir)
    assert "model.layers.0.self_attn.q_proj" in names and "lm_head" in names  # tied, still a module
    with pytest.raises(ConfigError, match=r"learner.lora_target_modules \['c_attn'\] match no module .*q_proj"):
        load_config(None, [f"model.path={tiny_model_dir}", "learner.lora_rank=8", "learner.lora_target_modules=[c_attn]"])
    load_config(None, [f"model.path={tiny_model_dir}", "learner.lora_rank=8", "learner.lora_target_modules=[q_proj, wq]"])


def test_a_model_dir_without_tokenizer_files_is_refused(tiny_model_dir, tmp_path):
    """Issue 30 case 4: transformers builds an empty tokenizer from config.json, and every prompt is 0 tokens."""
    bare = copy_model(tiny_model_dir, tmp_path / "bare")
    for f in bare.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(DataError, match="its tokenizer has no vocabulary"):
        load_tokenizer(str(bare))
    # the intact directory loads the tokenizer it was built with: one token per character, none unknown
    tok = load_tokenizer(str(tiny_model_dir))
    ids = tok("12+34=", add_special_tokens=False)["input_ids"]
    assert len(ids) == 6 and tok.unk_token_id not in ids and tok.decode(ids) == "12+34="


def without_eos(tiny_model_dir, dst):
    """The tiny model with no EOS declared anywhere (tokenizer, generation config, model config)."""
    no_eos = copy_model(tiny_model_dir, dst)
    for name, key in (("tokenizer_config.json", "eos_token"), ("config.json", "eos_token_id")):
        data = json.loads((no_eos / name).read_text())
        data.pop(key)
        (no_eos / name).write_text(json.dumps(data))
    (no_eos / "generation_config.json").unlink()
    return no_eos


def test_a_model_without_any_eos_is_warned_about_with_the_consequence(tiny_model_dir, tmp_path):
    """Issue 30 case 7: every completion ran to max_new_tokens with no warning."""
    no_eos = without_eos(tiny_model_dir, tmp_path / "noeos")
    warning = eos_warning(str(no_eos), load_config(None, [f"model.path={no_eos}"]).rollout)
    assert "every completion runs to rollout.max_new_tokens=32" in warning and "cannot learn to stop" in warning
    assert eos_warning(str(no_eos), load_config(None, [f"model.path={no_eos}", "rollout.stop=['\\n']"]).rollout) is None
    fixed = load_config(None, [f"model.path={no_eos}", "rollout.min_new_tokens=32"]).rollout  # fixed length on purpose
    assert eos_warning(str(no_eos), fixed) is None
    assert eos_warning(str(tiny_model_dir), load_config(None, [f"model.path={tiny_model_dir}"]).rollout) is None


def test_a_checkpoint_of_another_model_is_named_before_any_actor_starts(tiny_model_dir, tmp_path):
    ckpt = tmp_path / "step-00000002"
    (ckpt / "hf-config").mkdir(parents=True)
    shutil.copy(tiny_model_dir / "config.json", ckpt / "hf-config" / "config.json")
    assert checkpoint_model_problems(ckpt, str(tiny_model_dir), "hf-config") == []
    bigger = copy_model(tiny_model_dir, tmp_path / "bigger", hidden_size=256, intermediate_size=1024)
    [problem] = checkpoint_model_problems(ckpt, str(bigger), "hf-config")
    assert "was trained from another model" in problem and "hidden_size 128 vs 256" in problem
