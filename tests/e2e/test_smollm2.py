"""A real pretrained model through the CLI as a user runs it (issue 38): SmolLM2-135M-Instruct, a
Llama with tied input/output embeddings, grouped-query attention (9 query / 3 KV heads), a 49,152
token vocabulary and a ChatML template with its own default system prompt (tests/conftest.py
`smollm2_dir`; skipped, with the reason, where it cannot be fetched).

Kept few and short (issue 58: no test over 120 s on the slower machine): the conversion checked against
the GGUF, `raygrpo data`, and two 2-step `raygrpo train` runs (full weights on 2 ZeRO-2 ranks with the
calculator; LoRA with merged sync on 2 ZeRO-3 ranks with the reference actor, continuing from the ZeRO-2
run's export), 2 prompts x G=2, 8-12 new tokens each. Real Ray, vLLM, DeepSpeed. Alone on a quiet 2-core
Intel Xeon each run's test takes 40-70 s, nearly all of it the stack's fixed cost (start-up, the final
checkpoint and export, ZeRO-3's gathers); beside another worker (CI, load ~6) the same tests took 160-200 s.
"""
from __future__ import annotations

import json
import math
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from cluster.models.smollm2 import fetch_gguf, verification
from cluster.models.tinymodel import num_parameters
from cluster.models.wordproblems import conversational_rows, write_jsonl
from cluster.run.metrics import read_metrics
from learner.grpo import token_logprobs
from tests.conftest import CACHE

BIN = Path(sys.executable).parent
LENGTH_REWARD = "def reward(prompt, completion, **kw):\n    return len(completion) / 10\n"  # varies within a group
# The length reward, reading the whole conversation as a multi-turn run gives it (`_messages`, `_turns`,
# `_num_tokens`: actors/rewards/scorer.py). A failed assertion here is a reward error, which the test counts.
CONVERSATION_REWARD = """
def reward(prompt, completion, _messages, _turns, _num_tokens, **kw):
    assert _messages[:len(prompt)] == prompt, _messages
    turns = _messages[len(prompt):]  # the model's answers, each calc() call's tool message after it
    answers = [m for m in turns if m["role"] == "assistant"]
    assert answers[-1] == {"role": "assistant", "content": completion} and len(answers) == _turns, (turns, completion)
    assert turns[-1]["role"] == "assistant" or _turns == 2, turns  # the tool's answer to a last turn's call is kept
    assert {m["role"] for m in turns} <= {"assistant", "tool"} and 0 < _num_tokens <= 2 * 12, (turns, _num_tokens)
    return len(completion) / 10
"""


def project(root: Path, model_dir: Path, *extra: str, rollout: str = "max_new_tokens: 16, max_model_len: 160",
            rows: list[dict] | None = None, reward: str = "length.py:reward") -> Path:
    """A user's project directory: chat rows (a system prompt of their own), a reward, run.yaml."""
    proj = root / "proj"
    proj.mkdir()
    write_jsonl(proj / "train.jsonl", rows or conversational_rows(4, seed=5))
    (proj / "length.py").write_text(LENGTH_REWARD)
    (proj / "conversation.py").write_text(CONVERSATION_REWARD)
    (proj / "run.yaml").write_text("\n".join([
        f"model: {{path: {model_dir}}}",
        "data: {train: train.jsonl, num_eval: 0}",
        "trainer: {steps: 2, prompts_per_step: 2, group_size: 2, run_dir: runs/smollm2, actor_timeout_s: 600}",
        f"rollout: {{{rollout}}}",
        f"reward: {{functions: ['{reward}']}}",
        "metrics: {tensorboard: false}",
        *extra, ""]))
    return proj


def raygrpo(*args, cwd: Path, timeout: int = 1500) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "raygrpo"), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_the_converted_model_is_the_gguf_model(smollm2_dir):
    """Loaded from its directory as any user would, the model's logits equal the GGUF-loaded model's
    to 1e-5 and its greedy answer to a fixed chat prompt is English; every file is world-readable. (Where
    the fixture converted the model in this process, its conversion's check of these files is read, not
    made again: cluster/models/smollm2.py `verification`.)"""
    result = verification(smollm2_dir, fetch_gguf(CACHE / "smollm2-gguf"))
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


# Rows whose conversation shows the calculator once (a 135M model writes calc() by itself only
# after an example), then asks a product.
CALC_SYSTEM = "You have a calculator: write calc(EXPRESSION) and the tool answers."
CALC_ROWS = [{"prompt": [{"role": "system", "content": CALC_SYSTEM}, {"role": "user", "content": "What is 12 * 5?"},
                         {"role": "assistant", "content": "calc(12 * 5)"}, {"role": "tool", "content": "60"},
                         {"role": "assistant", "content": "#### 60"}, {"role": "user", "content": f"What is {a} * {b}?"}],
              "answer": str(a * b)} for a, b in ((17, 23), (14, 31), (26, 19), (38, 12))]


def train_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir) if r.get("kind") == "train"]


@pytest.fixture(scope="module")
def zero2_run(smollm2_dir, tmp_path_factory):
    """One `raygrpo train` run that several tests read: all 134.5M weights on 2 learner ranks under
    ZeRO-2 (so the learner shares each prompt's forward pass among its completions), a KL term with
    the reference on the learner, and multi-turn rollouts with the built-in calculator: 2 steps of 2
    prompts x G=2, up to 2 turns of 12 tokens. The calculator's long prompts (86 tokens: the example
    conversation) are trained here, where each is computed once for its group, rather than under
    ZeRO-3, which computes every sequence whole (issue 58: that run took 114 s with them, at load 5-7).
    Its reward reads the whole conversation (CONVERSATION_REWARD), and the console is at --log-level
    INFO (third-party lines back in it; the default level keeps them out: test_progress_and_throughput.py on
    the finished run, test_external_cluster.py's run by address)."""
    proj = project(tmp_path_factory.mktemp("zero2"), smollm2_dir, "learner: {lr: 5.0e-5, num_ranks: 2, zero_stage: 2}",
                   "algo: {beta: 0.05}", "reference: {placement: learner}",
                   rollout="env: calculator, max_turns: 2, max_new_tokens: 12, max_model_len: 256", rows=CALC_ROWS,
                   reward="conversation.py:reward")
    out = raygrpo("train", "run.yaml", "--log-level", "INFO", cwd=proj)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return proj / "runs" / "smollm2", out.stdout + out.stderr


@pytest.mark.timeout(1800)
def test_full_fine_tuning_on_two_zero2_ranks_with_the_calculator_keeps_the_engine_equal_to_the_learner(
        smollm2_dir, zero2_run):
    """What the weight sync sends for a tied model: the shared embedding once, under
    `model.embed_tokens.weight` (no `lm_head.weight`), 538,060,032 bytes = 134,515,008 float32
    parameters; vLLM's Llama ties its LM head to that embedding, so both move with it (shown
    directly in test_smollm2_logprobs.py). Here: the sync verified at every step; at step 1 the
    reference (a frozen copy on each rank) equals the policy (KL 0 to float rounding); after step
    1's update the policy has moved from it, yet the learner's log-probs (prompt sharing on) of the
    tokens the engine sampled at step 2 equal the engine's own to 1e-4, on multi-turn trajectories
    whose calculator calls were answered (environment tokens out of the loss). The conversation reward
    scored every trajectory (its assertions held), and --log-level INFO let vLLM's lines into the console
    beside raygrpo's."""
    run_dir, console = zero2_run
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["sync_verified"] for r in rows), rows
    assert all(r["sync_bytes"] == 4 * num_parameters(smollm2_dir) for r in rows)  # the tied embedding sent once
    assert rows[0]["kl"] < 1e-6 and rows[1]["kl"] > 1e-3, rows
    assert all(r["grad_norm"] > 0 and math.isfinite(r["loss"]) for r in rows), rows
    assert all(r["logprob_diff_max"] < 1e-4 for r in rows), [(r["logprob_diff_mean"], r["logprob_diff_max"]) for r in rows]
    assert "the completions of a prompt share its forward pass" in console, console[-3000:]
    assert "prompt sharing is off" not in console
    assert "Successfully reset prefix cache" in console and "step 2/2" in console  # vLLM's INFO line (each sync), raygrpo's
    assert all(r["reward_errors"] == 0 for r in rows), rows
    assert all(r["env_errors"] == 0 and r["env_overflows"] == 0 and r["env_s"] >= 0 for r in rows), rows
    assert max(r["tool_calls_mean"] for r in rows) > 0 and max(r["turns_mean"] for r in rows) > 1, rows
    assert all(r["env_tokens_mean"] > 0 for r in rows if r["tool_calls_mean"] > 0), rows


@pytest.mark.timeout(1800)
def test_the_export_loads_in_transformers_with_the_chat_template_and_the_trained_weights(smollm2_dir, zero2_run):
    """The full-weight export (`hf_model/`, after 2 updates) loads in transformers, embeddings still
    tied, chat template and EOS kept, and holds the trained weights. vLLM serving it: the LoRA run
    below trains from this export (its engine's log-probs equal the learner's transformers model's)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = zero2_run[0] / "hf_model"
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(smollm2_dir).chat_template
    assert tokenizer.eos_token == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"},
                                         {"role": "assistant", "content": "2 + 3 = 5\n#### 5"}],
                                        return_tensors="pt", return_dict=True)["input_ids"]
    base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        trained = token_logprobs(model(input_ids=ids).logits[:, :-1], ids[:, 1:])[0]
        before = token_logprobs(base(input_ids=ids).logits[:, :-1], ids[:, 1:])[0]
    assert (trained - before).abs().max() > 1e-3  # the export holds the trained weights, not the original ones


@pytest.mark.timeout(1800)
def test_lora_on_two_zero3_ranks_with_the_reference_actor_trains_from_the_export_and_exports_it(
        smollm2_dir, zero2_run, tmp_path):
    """`raygrpo train` continuing from the ZeRO-2 run's export, as a user continues from an exported model:
    LoRA rank 8 on the attention and MLP projections of 2 ZeRO-3 ranks (each holds half of every base
    weight: SmolLM2's are above ZeRO-3's persistence threshold, so every forward gathers them, which the tiny
    models' never do), merged sync (learner.lora_sync=merged: base + adapter merged a layer group at a time,
    sent as the whole tied model, the embedding once), and the reference as its own actor. Shown:
    - the engine is vLLM serving the export (`raygrpo data` renders its chat prompts with the export's ChatML
      template and stops at its EOS), and at step 1 the learner's log-probs of the sampled tokens equal the
      engine's to 1e-4 (the export as transformers loads it); the reference actor's equal the policy's (KL 0:
      the adapter starts at zero), the policy moves by step 2, and learner and engine still agree;
    - the export holds the trained adapter: merged (transformers, embeddings still tied, chat template and EOS
      kept) equal to peft's base + adapter/, and different from the base;
    - the run's checkpoint leaves the frozen base out (each rank's share of it was 270 MB).
    (Issue 58: one run where a ZeRO-3 full-weight run and a LoRA adapter-sync run were two. vLLM applying a
    LoRA adapter itself, eagerly on CPU: tests/e2e/test_lora_end_to_end.py on the tiny model, 2 ZeRO-3 ranks.)"""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = zero2_run[0] / "hf_model"
    proj = project(tmp_path, export, "learner: {lr: 2.0e-3, lora_rank: 8, lora_sync: merged, num_ranks: 2, "
                   "zero_stage: 3}", "algo: {beta: 0.05}", "reference: {placement: actor}",
                   rollout="max_new_tokens: 8, max_model_len: 160")
    out = raygrpo("train", "run.yaml", cwd=proj)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run_dir = proj / "runs" / "smollm2"
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert Path(config["model"]["path"]).resolve() == export.resolve(), config["model"]
    assert num_parameters(export) == num_parameters(smollm2_dir)  # still tied: the embedding stored once
    preview = raygrpo("data", "run.yaml", "-n", "1", cwd=proj, timeout=300)
    assert preview.returncode == 0, preview.stderr[-3000:]
    assert "eos '<|im_end|>' (2), pad '<|im_end|>' (2); chat template: yes" in preview.stdout, preview.stdout
    assert "generation stops at token ids [2]" in preview.stdout, preview.stdout
    assert "<|im_start|>system\nSolve the problem." in preview.stdout, preview.stdout

    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["sync_verified"] and r["sync_bytes"] == 4 * num_parameters(smollm2_dir) for r in rows), rows
    assert all(r["ref_s"] > 0 for r in rows), rows  # the reference actor scored each batch
    assert rows[0]["kl"] < 1e-6 and rows[0]["grad_norm"] > 0 and rows[1]["kl"] > 1e-3, rows
    assert all(r["logprob_diff_max"] < 1e-4 for r in rows), [(r["logprob_diff_mean"], r["logprob_diff_max"]) for r in rows]
    # its checkpoint holds the adapter and its optimizer state, not the ranks' shares of the frozen base (539 MB)
    last = sorted((run_dir / "checkpoints").glob("step-*"))[-1] / "learner"
    assert sum(f.stat().st_size for f in last.glob("*model_states.pt")) < 4 * num_parameters(smollm2_dir) / 20

    lora_export = run_dir / "hf_model"
    tokenizer = AutoTokenizer.from_pretrained(lora_export)
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(smollm2_dir).chat_template
    assert tokenizer.eos_token == "<|im_end|>"
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    assert tokenizer.decode(ids[0]).endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    merged = AutoModelForCausalLM.from_pretrained(lora_export, dtype=torch.float32).eval()
    assert merged.config.tie_word_embeddings and merged.lm_head.weight.data_ptr() == merged.model.embed_tokens.weight.data_ptr()
    base = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = base(ids).logits
        adapted = PeftModel.from_pretrained(base, str(lora_export / "adapter")).eval()
        assert sum(p.numel() for n, p in adapted.named_parameters() if "lora_" in n) == 2_442_240  # q/k/v/o/gate/up/down x 30
        merged_logits = merged(ids).logits
        # float32 rounding of W + BA against W x + B(A x) over 30 layers, on logits up to ~40: 1.4e-4
        # measured (the tiny models stay under 1e-4)
        assert (merged_logits - adapted(ids).logits).abs().max() < 1e-3
    assert (merged_logits - base_logits).abs().max() > 0.1  # the export holds the trained adapter
