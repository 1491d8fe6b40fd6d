"""A real pretrained model through the CLI as a user runs it (issue 38): SmolLM2-135M-Instruct, a
Llama with tied input/output embeddings, grouped-query attention (9 query / 3 KV heads), a 49,152
token vocabulary and a ChatML template with its own default system prompt (tests/conftest.py
`smollm2_dir`; skipped, with the reason, where it cannot be fetched).

Kept few and short (the suite must stay under 30 minutes): the conversion checked against the GGUF,
`raygrpo data`, and two 2-step `raygrpo train` runs (full weights; LoRA), 2 prompts x G=2, 16 new
tokens each. Real Ray, vLLM, DeepSpeed.
"""
from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cluster.models.smollm2 import check_against_gguf, fetch_gguf
from cluster.models.tinymodel import num_parameters
from cluster.models.wordproblems import conversational_rows, write_jsonl
from cluster.run.metrics import read_metrics
from tests.conftest import CACHE

BIN = Path(sys.executable).parent
LENGTH_REWARD = "def reward(prompt, completion, **kw):\n    return len(completion) / 10\n"  # varies within a group


def project(root: Path, model_dir: Path, *extra: str) -> Path:
    """A user's project directory: chat rows (a system prompt of their own), a reward, run.yaml."""
    proj = root / "proj"
    proj.mkdir()
    write_jsonl(proj / "train.jsonl", conversational_rows(4, seed=5))
    (proj / "length.py").write_text(LENGTH_REWARD)
    (proj / "run.yaml").write_text("\n".join([
        f"model: {{path: {model_dir}}}",
        "data: {train: train.jsonl, num_eval: 0}",
        "trainer: {steps: 2, prompts_per_step: 2, group_size: 2, run_dir: runs/smollm2, actor_timeout_s: 600}",
        "rollout: {max_new_tokens: 16, max_model_len: 160}",
        "reward: {functions: ['length.py:reward']}",
        "metrics: {tensorboard: false}",
        *extra, ""]))
    return proj


def raygrpo(*args, cwd: Path, timeout: int = 1500) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "raygrpo"), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_the_converted_model_is_the_gguf_model(smollm2_dir):
    """Loaded from its directory as any user would, the model's logits equal the GGUF-loaded model's
    to 1e-5 and its greedy answer to a fixed chat prompt is English; every file is world-readable."""
    result = check_against_gguf(smollm2_dir, fetch_gguf(CACHE / "smollm2-gguf"))
    assert result.problems() == [], result
    assert "Paris" in result.greedy_text, result.greedy_text  # "What is the capital of France?"
    for f in smollm2_dir.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) & 0o044 == 0o044, f
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert (config["architectures"], config["tie_word_embeddings"], config["num_key_value_heads"], config["vocab_size"]) == (
        ["LlamaForCausalLM"], True, 3, 49152)
    assert "quantization_config" not in config
    assert num_parameters(smollm2_dir) == 134_515_008  # the tied embedding stored once


def test_data_preview_shows_the_chat_template_and_stop_ids(smollm2_dir, tmp_path):
    proj = project(tmp_path, smollm2_dir)
    out = raygrpo("data", "run.yaml", "-n", "1", cwd=proj, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "eos '<|im_end|>' (2), pad '<|im_end|>' (2); chat template: yes" in text, text
    assert "generation stops at token ids [2]" in text, text
    # the user's system prompt replaces SmolLM's default one; ChatML as the engine receives it
    assert "<|im_start|>system\nSolve the problem. End with the answer after ####.<|im_end|>\n<|im_start|>user\n" in text, text
    assert "named SmolLM" not in text
    assert text.rstrip().count("train: 4 rows, 0 filtered") == 1, text


def train_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir) if r.get("kind") == "train"]


@pytest.mark.timeout(1800)
def test_full_fine_tuning_through_the_cli_keeps_the_engine_equal_to_the_learner(smollm2_dir, tmp_path):
    """`raygrpo train`, all 134.5M weights, with a KL term (the reference on the learner).

    What the weight sync sends for a tied model: the shared embedding once, under
    `model.embed_tokens.weight` (no `lm_head.weight`), 538,060,032 bytes = 134,515,008 float32
    parameters; vLLM's Llama ties its LM head to that embedding, so both move with it. Shown here:
    after step 1's update the policy has moved far from the reference (kl), yet the learner's
    log-probs of the tokens the engine sampled at step 2 equal the engine's own to 1e-4, which they
    could not if the engine's output layer (or any layer) still held the old weights."""
    proj = project(tmp_path, smollm2_dir, "learner: {lr: 5.0e-5}", "algo: {beta: 0.05}")
    out = raygrpo("train", "run.yaml", cwd=proj)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = train_rows(proj / "runs" / "smollm2")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["sync_verified"] for r in rows), rows
    assert all(r["sync_bytes"] == 4 * num_parameters(smollm2_dir) for r in rows)  # the tied embedding sent once
    assert rows[0]["grad_norm"] > 0 and rows[1]["kl"] > 1e-3, rows  # step 1 trained; step 2's policy moved
    assert all(r["logprob_diff_max"] < 1e-4 for r in rows), [(r["logprob_diff_mean"], r["logprob_diff_max"]) for r in rows]


@pytest.mark.timeout(1800)
def test_lora_through_the_cli_syncs_the_adapter_and_exports_with_the_chat_template(smollm2_dir, tmp_path):
    """`raygrpo train` with LoRA rank 8 on the attention and MLP projections (the tied embedding
    stays frozen, so nothing of it travels): only the adapter is sent, verified at every step, the
    engine applying it agrees with the learner; the export loads in transformers (merged) and
    peft (adapter/) and keeps the model's chat template."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    proj = project(tmp_path, smollm2_dir, "learner: {lr: 2.0e-3, lora_rank: 8}", "algo: {beta: 0.05}")
    out = raygrpo("train", "run.yaml", cwd=proj)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run_dir = proj / "runs" / "smollm2"
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["sync_verified"] for r in rows), rows
    adapter_bytes = 4 * 2_442_240  # rank 8 on q/k/v/o/gate/up/down of 30 layers, float32
    assert all(r["sync_bytes"] == adapter_bytes for r in rows), [r["sync_bytes"] for r in rows]
    assert rows[1]["kl"] > 1e-3 and all(r["logprob_diff_max"] < 1e-4 for r in rows), rows

    export = run_dir / "hf_model"
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(smollm2_dir).chat_template
    assert tokenizer.eos_token == "<|im_end|>"
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    assert tokenizer.decode(ids[0]).endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    merged = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    assert merged.config.tie_word_embeddings and merged.lm_head.weight.data_ptr() == merged.model.embed_tokens.weight.data_ptr()
    base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = base(ids).logits
        adapted = PeftModel.from_pretrained(base, str(export / "adapter")).eval()
        merged_logits = merged(ids).logits
        # float32 rounding of W + BA against W x + B(A x) over 30 layers, on logits up to ~40: 1.4e-4
        # measured (the tiny models stay under 1e-4); the trained adapter moves them by ~6
        assert (merged_logits - adapted(ids).logits).abs().max() < 1e-3
    assert (merged_logits - base_logits).abs().max() > 0.1  # the export holds the trained adapter
