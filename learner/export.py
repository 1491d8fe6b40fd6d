"""A plain HF model directory from the learner's weights or from a checkpoint (`raygrpo export`),
without Ray or DeepSpeed processes: safetensors weights + config + tokenizer, which transformers'
from_pretrained and vLLM load. A LoRA checkpoint is merged into its base model, and its adapter
is copied beside it in peft format.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch
from huggingface_hub import save_torch_state_dict

from learner.checkpoint import (
    ADAPTER_DIR,
    HF_META_DIR,
    LEARNER_TAG,
    match_umask,
    naming_save_errors,
    safe_torch_load,
    verify,
    write_hf_meta,
)
from learner.hf_dir import base_weights_problem


def write_hf_dir(state_dict: dict[str, torch.Tensor], out_dir: str | os.PathLike, meta_dir: str | os.PathLike) -> str:
    """A plain HF model directory: safetensors weights (sharded past 5 GB) + config + tokenizer from
    `meta_dir` (the original model path or a checkpoint's hf-config/). Loads in transformers and vLLM."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_hf_meta(str(meta_dir), out)
    aliases = _tied_aliases(str(meta_dir))
    # Own storage per tensor: zero_to_fp32 hands out views into flat partitions, which safetensors
    # refuses to save. Tied aliases (lm_head.weight) are left out, as save_pretrained does; HF and
    # vLLM re-tie them on load.
    sd = {k: v.detach().to("cpu").clone() for k, v in state_dict.items()
          if not (k in aliases and aliases[k] in state_dict)}
    save_torch_state_dict(sd, out, max_shard_size="5GB", safe_serialization=True)
    match_umask(out)
    return str(out)


def _tied_aliases(meta_dir: str) -> dict[str, str]:
    """{alias: target} of the weights the model ties (e.g. lm_head.weight -> embed_tokens), or {}."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(meta_dir)
    if not getattr(config, "tie_word_embeddings", False):
        return {}
    try:
        tied = AutoModelForCausalLM._model_mapping[type(config)]._tied_weights_keys or {}
    except (KeyError, AttributeError):
        tied = {}
    if isinstance(tied, dict):
        return dict(tied)
    return {"lm_head.weight": "model.embed_tokens.weight"}  # older list form: the usual pair


# What marks a directory as a run dir (cluster/run/rundir.py writes the lock; the trainer the rest).
RUN_DIR_MARKERS = ("raygrpo.lock", "checkpoints", "metrics.jsonl")


def export_target_problem(out: Path, ckpt: Path) -> str | None:
    """Why `out` must never be an export's target, whatever --overwrite says: it is, holds or is inside
    the source checkpoint, or it is or holds a run dir (its checkpoints and metrics would be replaced)."""
    for here, dirs, files in os.walk(out) if out.is_dir() else ():
        found = sorted(set(RUN_DIR_MARKERS) & set(dirs + files))
        if found:
            where = Path(here)
            what = "is a run dir" if where == out else f"holds the run dir {where}"
            return f"{out} {what} ({', '.join(found)})"
    out_r, ckpt_r = out.resolve(), ckpt.resolve()
    if out_r == ckpt_r or ckpt_r in out_r.parents or out_r in ckpt_r.parents:
        return f"{out} is, holds or is inside the checkpoint being exported ({ckpt})"
    return None


def move_aside(path: Path) -> Path:
    """Rename `path` to a fresh sibling `<name>.replaced-<time>` (nothing is deleted)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = path.with_name(f"{path.name}.replaced-{stamp}")
    n = 1
    while aside.exists():
        aside, n = path.with_name(f"{path.name}.replaced-{stamp}-{n}"), n + 1
    os.replace(path, aside)
    return aside


def export_checkpoint(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike,
                      model_path: str | os.PathLike | None = None, overwrite: bool = False) -> str:
    """Consolidate a checkpoint's weights into a HF directory, without Ray or DeepSpeed processes.

    ckpt_dir: a checkpoint (root/step-N) or its DeepSpeed folder; model_path: where config and
    tokenizer come from (default: the checkpoint's own hf-config/). The target is never a run dir or
    the checkpoint itself (refused, whatever `overwrite` says). A non-empty `out_dir` is refused unless
    `overwrite`; then the new export is written beside it and the old contents are moved aside to
    `<out_dir>.replaced-<time>`, as `train --overwrite` does: nothing is deleted, and no stale shard of
    an older model stays in the new directory."""
    out = Path(out_dir)
    ckpt = Path(ckpt_dir)
    if not (ckpt / LEARNER_TAG).is_dir() and ckpt.name == LEARNER_TAG:
        ckpt = ckpt.parent
    refused = export_target_problem(out, ckpt)
    if refused:
        run = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent
        raise FileExistsError(f"refusing to export into {out}: {refused}. Nothing was changed; export into a new "
                              f"directory, e.g. {run / ('export-' + ckpt.name)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise FileExistsError(f"{out} is not empty: choose an empty or new directory, or pass --overwrite to "
                              f"move what is there aside ({out.name}.replaced-<time>)")
    if not (ckpt / LEARNER_TAG).is_dir():
        raise FileNotFoundError(f"{ckpt} is not a raygrpo checkpoint (no {LEARNER_TAG}/ folder)")
    problems = verify(ckpt)
    if problems:
        raise ValueError(f"checkpoint {ckpt} does not verify: " + "; ".join(problems[:5]))
    meta = Path(model_path) if model_path is not None else ckpt / HF_META_DIR
    if not (meta / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {meta}; pass the original model path")
    if (ckpt / ADAPTER_DIR / "adapter_config.json").is_file():
        def write(target):
            return _export_lora(ckpt, target, meta, model_path)
    else:
        with safe_torch_load():
            sd = _consolidated_from_deepspeed(ckpt)

        def write(target):
            return write_hf_dir(sd, target, meta)
    # Written beside the target, then renamed into place: a failed write (a full disk) leaves the target
    # as it was and takes its partial files away (their space back).
    staging = out.with_name(f".{out.name}.export-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        with naming_save_errors(out, kept="the export's target is left as it was"):
            write(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"--overwrite: moved the previous contents of {out} to {move_aside(out)}", flush=True)
    elif out.is_dir():
        out.rmdir()  # empty
    os.replace(staging, out)
    return str(out)


def _consolidated_from_deepspeed(ckpt: Path) -> dict[str, torch.Tensor]:
    ds_dir = ckpt / LEARNER_TAG
    if list(ds_dir.glob("*optim_states.pt")):  # ZeRO 1/2/3: merge the fp32 partitions
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag=LEARNER_TAG)
    # ZeRO-0: rank 0's model file holds the whole module
    files = sorted(ds_dir.glob("mp_rank_*_model_states.pt"))
    if not files:
        raise FileNotFoundError(f"no DeepSpeed model states in {ds_dir}")
    return {k: v.float() for k, v in torch.load(files[0], map_location="cpu", weights_only=True)["module"].items()}


def _export_lora(ckpt: Path, out_dir: str | os.PathLike, meta: Path, model_path) -> str:
    """A LoRA checkpoint: the base model with the adapter merged (plain HF dir) + the adapter itself
    under out_dir/adapter/. Base weights come from `model_path`, else from the path the run trained
    from (the adapter config's base_model_name_or_path): only the adapters were trained. Refused where
    those are no longer the weights the run trained from (the checkpoint's fingerprint of them)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter_dir = ckpt / ADAPTER_DIR
    base_path = Path(model_path) if model_path is not None else \
        Path(json.loads((adapter_dir / "adapter_config.json").read_text())["base_model_name_or_path"])
    if not (base_path / "config.json").is_file():
        raise FileNotFoundError(f"LoRA checkpoint: the base model {base_path} is gone; "
                                "pass its path (raygrpo export --model-path)")
    changed = base_weights_problem(ckpt, HF_META_DIR, base_path)
    if changed:
        raise ValueError(f"LoRA checkpoint {ckpt}: {changed}, and its adapter is merged into them. Pass the base "
                         "model the run trained from (raygrpo export --model-path)")
    base = AutoModelForCausalLM.from_pretrained(str(base_path), dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    out = write_hf_dir(merged.state_dict(), out_dir, meta)
    shutil.copytree(adapter_dir, Path(out) / ADAPTER_DIR, dirs_exist_ok=True)
    return out
