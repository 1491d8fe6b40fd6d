"""cluster/data/model_check.py: the model directory checked before any actor starts (issue 30 cases 4, 7, 9)."""
from __future__ import annotations

import json
import os
import shutil
from unittest import mock

import pytest

from cluster.config import ConfigError, load_config
from cluster.data.dataset import DataError, load_tokenizer
from cluster.data.model_check import checkpoint_model_problems, eos_warning, max_positions, module_names
from cluster.models.tinymodel import TinyModelSpec, build_tiny_model
from learner.hf_dir import BASE_WEIGHTS, SAMPLE_BYTES, SAMPLES, fingerprint_differences, weights_fingerprint


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


def test_a_resume_that_takes_weights_from_a_changed_model_path_is_refused(tiny_model_dir, tmp_path):
    """A LoRA checkpoint holds only its adapter, and a KL term's reference is loaded from model.path: resumed
    on other weights there (same architecture), the run would go on as a run that never was. The checkpoint's
    fingerprint of model.path's weights (learner/hf_dir.py) finds it, where a copy of the model is fine and a
    run that takes nothing from model.path (full weights, no KL term) is not asked."""
    ckpt = tmp_path / "step-00000002"
    (ckpt / "hf-config").mkdir(parents=True)
    shutil.copy(tiny_model_dir / "config.json", ckpt / "hf-config" / "config.json")
    (ckpt / "hf-config" / BASE_WEIGHTS).write_text(json.dumps(weights_fingerprint(tiny_model_dir)))
    copied = shutil.copytree(tiny_model_dir, tmp_path / "copied")
    other = build_tiny_model(tmp_path / "other", TinyModelSpec(hidden_size=128, num_layers=2, seed=1))  # as tiny_model_dir but the seed
    assert checkpoint_model_problems(ckpt, str(copied), "hf-config", lora=True, beta=0.05) == []
    assert checkpoint_model_problems(ckpt, str(other), "hf-config") == []  # it takes every weight from the checkpoint
    [lora] = checkpoint_model_problems(ckpt, str(other), "hf-config", lora=True)
    assert f"{other} no longer holds the weights the run trained from (model.safetensors holds other weights)" in lora
    assert "the frozen base of its LoRA adapter" in lora and "reference" not in lora and "checkpoint.resume=none" in lora
    [kl] = checkpoint_model_problems(ckpt, str(other), "hf-config", beta=0.05)
    assert "the reference model of the KL term (algo.beta > 0)" in kl and "LoRA" not in kl
    (ckpt / "hf-config" / BASE_WEIGHTS).unlink()  # a checkpoint from before the fingerprint: not refused
    assert checkpoint_model_problems(ckpt, str(other), "hf-config", lora=True) == []


def test_the_weights_fingerprint_samples_the_whole_file_and_reads_only_4_mib(tmp_path):
    """64 samples of 64 KiB, evenly spaced: a change anywhere a sample lands is seen, as is any change of size;
    a 40 MiB file is fingerprinted from 4 MiB of it."""
    model = tmp_path / "m"
    model.mkdir()
    data = bytearray(os.urandom(40 << 20))
    (model / "model-00001-of-00001.safetensors").write_bytes(data)
    before = weights_fingerprint(model)
    reads = []

    class Counted:  # the file, its reads counted
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def seek(self, offset):
            self.f.seek(offset)

        def read(self, n):
            reads.append(len(chunk := self.f.read(n)))
            return chunk

    with mock.patch("learner.hf_dir.open", lambda path, mode: Counted(open(path, mode)), create=True):
        assert weights_fingerprint(model) == before
    assert sum(reads) == SAMPLES * SAMPLE_BYTES == 4 << 20
    data[(40 << 20) // SAMPLES * 37 + 5] ^= 1  # a byte inside the 38th sample
    (model / "model-00001-of-00001.safetensors").write_bytes(data)
    assert fingerprint_differences(before, weights_fingerprint(model)) == ["model-00001-of-00001.safetensors holds other weights"]
    (model / "model-00001-of-00001.safetensors").write_bytes(data + b"x")
    (model / "pytorch_model.bin").write_bytes(b"y")
    assert fingerprint_differences(before, weights_fingerprint(model)) == [
        "model-00001-of-00001.safetensors is 41,943,041 bytes, was 41,943,040", "pytorch_model.bin is new"]
