"""LoRA config checks and the learner's LoRA naming / merge helpers (peft on a tiny model, no DeepSpeed)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from actors.transport.lora_adapter import adapter_dir
from learner.config import LearnerConfig
from learner.lora import adapter_name, apply_lora, hf_name, merge_map, merged, param_counts


def test_lora_config_problems_and_engine_rank():
    assert LearnerConfig().problems() == [] and LearnerConfig().vllm_max_lora_rank() == 0  # full fine-tuning
    assert LearnerConfig(lora_rank=4).vllm_max_lora_rank() == 8  # rounded up to a value vLLM accepts
    assert LearnerConfig(lora_rank=33).vllm_max_lora_rank() == 64
    assert LearnerConfig(lora_rank=16, lora_sync="merged").vllm_max_lora_rank() == 0  # engines without LoRA
    bad = LearnerConfig(lora_rank=8, lora_sync="both", lora_alpha=0, lora_dropout=1.0, lora_target_modules=[])
    problems = " ".join(bad.problems())
    for key in ("lora_sync", "lora_alpha", "lora_dropout", "lora_target_modules"):
        assert f"learner.{key}" in problems
    assert any("lora_rank" in p for p in LearnerConfig(lora_rank=600).problems())
    assert LearnerConfig(lora_rank=600, lora_sync="merged").problems() == []
    assert LearnerConfig(lora_rank=-1).problems()


def test_names_and_merge_match_peft(tiny_model_dir):
    """The merged view (hf_name + merge_map + merged) equals peft's own merge_and_unload."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32),
                       LearnerConfig(lora_rank=4, lora_alpha=8))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at 0; make the adapter do something
            p.data.normal_(0, 0.1)
    counts = param_counts(model)
    assert 0 < counts["trainable_params"] < counts["total_params"]
    assert all(p.requires_grad == ("lora_" in n) for n, p in model.named_parameters())

    params = dict(model.named_parameters())
    adapters = {adapter_name(n) for n in params} - {None}
    assert adapters and all(".default." not in n and ".lora_" in n for n in adapters)
    mm = merge_map(model)
    ours = {hf_name(n): p for n, p in params.items() if hf_name(n) is not None}
    ours = {k: merged(p, *mm[k][:2], mm[k][2]) if k in mm else p.detach() for k, p in ours.items()}
    theirs = dict(model.merge_and_unload().named_parameters())
    assert set(ours) == set(theirs)
    assert len(mm) == 2 * 7  # every linear projection of both layers
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) < 1e-6


def test_unknown_target_module_is_named(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    with pytest.raises(ValueError, match="lora_target_modules"):
        apply_lora(model, LearnerConfig(lora_rank=4, lora_target_modules=["no_such_proj"]))


def test_engine_adapter_dirs_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"raygrpo-lora-{int(dead.stdout)}"
    (stale / "v3").mkdir(parents=True)
    other = tmp_path / "raygrpo-lora-notapid"
    other.mkdir()
    mine = adapter_dir(str(tmp_path))
    assert mine == str(tmp_path / f"raygrpo-lora-{os.getpid()}") and os.path.isdir(mine)
    assert not stale.exists() and other.exists()
    assert adapter_dir(str(tmp_path)) == mine  # idempotent: a live process's dir stays
