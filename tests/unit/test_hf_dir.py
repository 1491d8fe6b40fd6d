"""learner/hf_dir.py: an exported model directory cut short is told from a whole one."""
import json

import torch
from safetensors.torch import save_file

from learner.hf_dir import hf_dir_problem


def test_a_whole_dir_passes_and_each_torn_state_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    save_file({"w": torch.ones(64, 64)}, str(tmp_path / "model.safetensors"))
    assert hf_dir_problem(tmp_path) is None
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-100])
    assert "model.safetensors is cut short" in hf_dir_problem(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(data[:5])
    assert "is cut short (5 bytes)" in hf_dir_problem(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    assert "has no weights" in hf_dir_problem(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-1.safetensors"}}))
    assert "model-1.safetensors is missing" in hf_dir_problem(tmp_path)
    (tmp_path / "config.json").unlink()
    assert "has no config.json" in hf_dir_problem(tmp_path)
