"""LoRA end to end: peft adapters on the DeepSpeed learner (2 ranks, ZeRO-2 and ZeRO-3), their sync
into real vLLM engines in both modes, the reference from the learner's own base model, exact
resume (a learner rank killed: the ranks restart from the last checkpoint) and export.

The check that an update arrived: vLLM's log-probs equal the learner's own peft model's within 1e-4 in fp32
(merged sync: prompt log-probs against `sequence_logprobs`, adapters on; adapter sync, in the LoRA run: each step's
sampled tokens, `logprob_diff_max`), and differ from the base model's.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from learner_ranks import make_batch, on_all, start_ranks, stop
from test_checkpoint_resume import _max_diff
from test_learner_weight_sync import TOL, _init_info, max_diff
from test_train import config, first_and_redone, kill_while_learning, train_rows

from cluster.driver.trainer import Trainer
from cluster.models.tinymodel import TinyModelSpec, build_tiny_model
from learner import checkpoint
from learner.config import AlgoConfig, LearnerConfig
from learner.export import export_checkpoint

pytestmark = pytest.mark.timeout(900)
RANK = 4


def model_states_bytes(checkpoint_dir) -> int:
    """Bytes of DeepSpeed's model files in a raygrpo checkpoint (where a frozen base would be)."""
    return sum(f.stat().st_size for f in (checkpoint_dir / checkpoint.LEARNER_TAG).glob("*model_states.pt"))


def test_merged_lora_sync_matches_the_learners_peft_model(ray_cluster, engine_pool, tiny_model_dir, tmp_path):
    """Merged sync (learner.lora_sync=merged: the adapter merged into the base weights, sent by the ordinary
    weight-sync path under plain HF names) on 2 ranks under ZeRO-2, into an engine without vLLM LoRA, leased from
    the session's pool (tests/e2e/engine_pool.py, which puts its weights back). Adapter-only sync, under ZeRO-3 with
    gradient checkpointing on 2 ranks (the riskiest peft combination: reentrant checkpointing, input grads, adapter
    gathers that are collective), into an engine that already serves an adapter, is the LoRA run below: its engine
    starts with vLLM's LoRA anyway, so this test needs no engine of its own.
    Then a checkpoint of these ZeRO-2 ranks: it holds the adapter and its optimizer state but not the frozen base
    (learner/checkpoint_state.py), and loading it after one more step brings the adapter back exactly (the module
    state is loaded without strictness, so a lost adapter would show here, not as an error)."""
    ray = ray_cluster
    # A large LR so one step moves the log-probs far beyond the tolerance (lora_B starts at 0).
    cfg = LearnerConfig(num_ranks=2, zero_stage=2, lr=2e-2, micro_batch_size=2, lora_rank=RANK, lora_alpha=16,
                        lora_sync="merged")
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (5, 17, 40)]
    with engine_pool.lease(tiny_model_dir) as (engine,):
        base = ray.get(engine.prompt_logprobs.remote(seqs))
        ranks = start_ranks(ray, tiny_model_dir, cfg, AlgoConfig())
        try:
            info = ray.get(ranks[0].info.remote())
            assert 0 < info["trainable_params"] < info["total_params"] / 10

            ray.get([w.init_weight_sync.remote([engine], _init_info()) for w in ranks])
            assert not on_all(ray, ranks, "train_step", make_batch(n=8, seed=7))["skipped"]
            result = on_all(ray, ranks, "sync_weights", 21)
            assert result["weight_version"] == 21 and result["bytes"] > 0
            assert ray.get(engine.get_weight_version.remote()) == "21"

            after = ray.get(engine.prompt_logprobs.remote(seqs))
            learner = on_all(ray, ranks, "sequence_logprobs", seqs)
            assert max_diff(after, learner) <= TOL
            assert max_diff(after, base) > 100 * TOL  # the step moved the adapter and the engine got it

            adapter = on_all(ray, ranks, "adapter_state_dict")
            assert all(".lora_A.weight" in k or ".lora_B.weight" in k for k in adapter)
            full = on_all(ray, ranks, "full_state_dict")
            assert result["bytes"] == sum(t.numel() * t.element_size() for t in full.values())  # the merged model

            root = tmp_path / "checkpoints"
            tmp = checkpoint.begin(root, 1)
            ray.get([w.save_checkpoint.remote(tmp, checkpoint.LEARNER_TAG) for w in ranks])
            saved = Path(checkpoint.commit(tmp, root, 1, {"weight_version": 21}, keep=1))
            adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
            assert model_states_bytes(saved) < 2 * adapter_bytes < result["bytes"] / 10, model_states_bytes(saved)
            assert not on_all(ray, ranks, "train_step", make_batch(n=8, seed=8))["skipped"]
            assert _max_diff(on_all(ray, ranks, "full_state_dict"), full) > 0  # the adapter moved on
            ray.get([w.load_checkpoint.remote(str(saved), checkpoint.LEARNER_TAG) for w in ranks])
            assert _max_diff(on_all(ray, ranks, "full_state_dict"), full) == 0
        finally:
            stop(ray, ranks)


def test_lora_run_reference_from_learner_resume_and_export(tiny_model_dir, ray_cluster, tmp_path):
    """LoRA (adapter mode, beta > 0) on 2 learner ranks under ZeRO-3 with gradient checkpointing: no reference
    actor; only the adapter synced (sync_bytes the exported adapter's bytes), verified at every step, and the
    engine's log-probs of the sampled tokens equal to the learner's peft model's after every update; a learner rank
    killed while it trains step 4: the ranks restart from the step-2 checkpoint (the adapter and its optimizer
    state) and the redone step 3 equals the first one (its batch generated again by the kept engine, given the
    restored adapter), and the export loads in transformers (merged) and peft (adapter/).

    (Formerly a second run resumed from a copy of this one's step-1 checkpoint, an engine start more: the restore
    of a LoRA checkpoint, the adapter re-synced and the reference from the restored base are the same here. A
    run dir resumed by a new run is test_rerun_export_resume.py's copied run dir and test_train.py's sync resume.)"""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    length = tmp_path / "length_reward.py"  # a reward that varies within a group: every step learns
    length.write_text("def reward(prompt, completion, **kw):\n    return len(completion) / 10\n")
    lora = ["learner.lora_rank=4", "learner.lora_sync=adapter", "algo.beta=0.05", "learner.lr=1e-2",
            f"reward.functions=[{length}:reward]", "checkpoint.every=2", "trainer.max_learner_restarts=1",
            # the riskiest peft combination for adapter-only sync: reentrant checkpointing, input grads, adapter
            # gathers that are collective across the ranks
            "learner.num_ranks=2", "learner.zero_stage=3", "learner.gradient_checkpointing=true"]
    full = tmp_path / "full"
    trainer = Trainer(config(tiny_model_dir, full, *lora, "trainer.steps=4"))
    killed = kill_while_learning(trainer, at_step=3, role="learner-0")  # training step 4; checkpoint at step 2
    trainer.run()
    assert killed and trainer.learner_restarts == 1
    rows = train_rows(full)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    placement = json.loads((full / "placement.json").read_text())
    roles = [p["role"] for p in placement]
    assert "reference" not in roles and {"learner-0", "learner-1"} <= set(roles)
    learner0 = next(p for p in placement if p["role"] == "learner-0")
    assert 0 < learner0["trainable_params"] < learner0["total_params"] / 10
    assert rows[-1]["kl"] > 0  # the learner's base model (adapters off) served the reference
    assert all(r["sync_verified"] for r in rows), rows
    # The engine's log-probs of each step's sampled tokens equal the learner's peft model's (fp32, TOL): after every
    # update (steps 2-4; step 1 samples before any) and after the resume's re-sync of the restored adapter (3-4).
    assert all(r["logprob_diff_max"] <= TOL for r in rows), [r["logprob_diff_max"] for r in rows]
    # And the updates moved those log-probs far from the base model's, so the equality needed the adapter: k3's KL
    # is at most expm1(0.01) - 0.01 < 5.02e-5 where |learner - reference| <= 100 * TOL on every token, so a mean kl
    # above that says a sampled token's learner log-prob is over 100 * TOL from the base model's.
    assert all(r["kl"] > 5.02e-5 for r in rows[1:]), [r["kl"] for r in rows]

    # step 3 was logged before the kill and redone after the resume from step 2
    first, again = first_and_redone(full, step=3, steps=[1, 2, 3, 4])
    assert first["reward_mean"] == again["reward_mean"], (first, again)
    assert first["gen_tokens"] == again["gen_tokens"]
    assert first["loss"] == pytest.approx(again["loss"], abs=1e-5)
    assert first["kl"] == pytest.approx(again["kl"], abs=1e-5) and again["kl"] > 0

    last = sorted((full / "checkpoints").glob("step-*"))[-1]
    out = tmp_path / "export"
    export_checkpoint(last, out)
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32),
                                           str(out / "adapter")).eval()
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    ids = torch.tensor([[5, 9, 17, 3, 22, 41, 7]])
    with torch.no_grad():
        a, b = merged(input_ids=ids).logits, peft_model(input_ids=ids).logits
        base = model(input_ids=ids).logits
    assert (a - b).abs().max() < 1e-4
    assert (a - base).abs().max() > 1e-3  # the export holds the trained adapter
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in peft_model.named_parameters() if ".lora_" in n)
    assert all(r["sync_bytes"] == adapter_bytes for r in rows), [r["sync_bytes"] for r in rows]  # only the adapter
    base_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert adapter_bytes < base_bytes / 4
    # the last checkpoint holds no rank's share of the frozen base (without exclude_frozen_parameters, ZeRO-3 writes it)
    assert model_states_bytes(last) < base_bytes / 10, model_states_bytes(last)
    # the base it trained from, fingerprinted in the checkpoint: a base of the same architecture with other weights
    # is refused, the adapter never merged into a model it was not trained on
    other = build_tiny_model(tmp_path / "other-base", TinyModelSpec(hidden_size=128, num_layers=2, seed=1))  # but the seed
    with pytest.raises(ValueError, match=f"{other} no longer holds the weights the run trained from "
                                         r"\(model.safetensors holds other weights\)"):
        export_checkpoint(last, tmp_path / "export-other", model_path=other)
    assert not (tmp_path / "export-other").exists()
    # the run's own end-of-run export agrees with the offline one
    assert (full / "hf_model" / "adapter" / "adapter_config.json").is_file()

