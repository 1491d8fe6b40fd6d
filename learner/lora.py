"""LoRA on the learner: peft adapters on the transformers model, their names in the two forms the
engines take, and the merged view of the weights.

Names. peft wraps the model as `base_model.model.<HF name>`; a wrapped linear layer keeps its
weight at `<module>.base_layer.weight` and its adapter at `<module>.lora_A.<adapter>.weight`.
  adapter form  what peft's save_pretrained writes and vLLM's LoRA loader reads: the full peft
                name without the adapter name (`...q_proj.lora_A.weight`).
  merged form   plain HF names (`model.layers.0.self_attn.q_proj.weight`) with
                W + scaling * B @ A, what vLLM's `load_weights` and transformers take.
Both are produced by learner/weight_sync.py's DeepSpeedWeightSource, a layer group at a time
(under ZeRO-3 never the whole model at once). The merge is computed out of place per group, so
the trained weights are never modified (no merge/unmerge round trip, no rounding left behind in
bf16 base weights).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from learner.config import LearnerConfig

ADAPTER = "default"  # peft's adapter name: the learner trains exactly one
_PREFIX = "base_model.model."


def apply_lora(model: torch.nn.Module, cfg: LearnerConfig) -> torch.nn.Module:
    """Wrap `model` with peft LoRA adapters; only they require grad."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                        target_modules=list(cfg.lora_target_modules), bias="none", task_type="CAUSAL_LM")
    # autocast_adapter_dtype=False: adapters in the base dtype. fp32 adapters beside bf16 base
    # weights break ZeRO-3's coalesced all-gather (DESIGN.md).
    try:
        return get_peft_model(model, config, autocast_adapter_dtype=False)
    except ValueError as e:  # e.g. "Target modules {...} not found in the base model"
        raise ValueError(f"learner.lora_target_modules {cfg.lora_target_modules}: {e}") from None


def numel(p: torch.nn.Parameter) -> int:
    """Whole size of a parameter (a ZeRO-3 parameter's .numel() is its shard)."""
    return int(p.ds_numel) if hasattr(p, "ds_numel") else p.numel()


def param_counts(model: torch.nn.Module) -> dict:
    trainable = sum(numel(p) for p in model.parameters() if p.requires_grad)
    total = sum(numel(p) for p in model.parameters())
    return {"trainable_params": trainable, "total_params": total}


def adapter_name(name: str) -> str | None:
    """peft parameter name -> the adapter form (None for base weights)."""
    if ".lora_" not in name:
        return None
    return name.replace(f".{ADAPTER}.", ".")


def hf_name(name: str) -> str | None:
    """peft parameter name -> the plain HF name of the weight it belongs to (None for adapters)."""
    if ".lora_" in name:
        return None
    name = name[len(_PREFIX):] if name.startswith(_PREFIX) else name
    return name.replace(".base_layer.", ".")


def merge_map(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Parameter, torch.nn.Parameter, float]]:
    """{HF weight name: (lora_A weight, lora_B weight, scaling)} of every adapted linear layer."""
    from peft.tuners.lora import LoraLayer

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            if getattr(module, "fan_in_fan_out", False):
                raise NotImplementedError(f"LoRA on {name}: fan_in_fan_out layers (GPT-2 Conv1D) are not supported")
            base = hf_name(f"{name}.base_layer.weight")
            out[base] = (module.lora_A[ADAPTER].weight, module.lora_B[ADAPTER].weight,
                         float(module.scaling[ADAPTER]))
    return out


def merged(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """W + scaling * B @ A, computed in float32 and returned in W's dtype (a new tensor)."""
    delta = lora_b.detach().float() @ lora_a.detach().float()
    return (weight.detach().float() + scaling * delta).to(weight.dtype)


def adapter_config_json(model: torch.nn.Module, base_model_path: str) -> str:
    """peft's adapter_config.json text for the model's adapter (what vLLM and PeftModel read)."""
    config = model.peft_config[ADAPTER]
    d = config.to_dict()
    for k, v in d.items():  # sets (target_modules) are not JSON; peft's own save does the same
        if isinstance(v, set):
            d[k] = sorted(v)
    d["base_model_name_or_path"] = str(base_model_path)
    return json.dumps(d, indent=2, sort_keys=True)


def write_adapter_dir(tensors: dict[str, torch.Tensor], config_json: str, out_dir: str | Path) -> str:
    """An adapter directory in peft format (PeftModel.from_pretrained / vLLM LoRARequest load it)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(config_json)
    return str(out)
