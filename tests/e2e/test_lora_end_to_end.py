"""LoRA end to end: peft adapters on the DeepSpeed learner (2 ranks, ZeRO-2 and ZeRO-3), their sync
into real vLLM engines in both modes, the reference from the learner's own base model, exact
resume (a learner rank killed: the ranks restart from the last checkpoint) and export.

The check that an adapter arrived: vLLM's prompt log-probs equal the learner's own peft-model
log-probs (`sequence_logprobs`, adapters on) within 1e-4 in fp32, and differ from the base model's.
"""
from __future__ import annotations

import json

import pytest
import torch
from learner_ranks import make_batch, on_all, start_ranks, stop
from test_learner_weight_sync import TOL, _init_info, max_diff
from test_train import config, first_and_redone, kill_while_learning, train_rows

from actors.config import RolloutConfig
from actors.rollout import RolloutWorker
from cluster.driver.trainer import Trainer
from learner.config import AlgoConfig, LearnerConfig
from learner.export import export_checkpoint

pytestmark = pytest.mark.timeout(900)
RANK = 4


@pytest.fixture(scope="module")
def engines(ray_cluster, engine_pool, tiny_model_dir):
    """One engine with vLLM LoRA (adapter mode), started here (vLLM's LoRA is set when an engine starts), and one
    without (merged mode: the ordinary weight sync), leased from the session's pool (tests/e2e/engine_pool.py),
    which puts its weights back when the module is done; shared by the tests."""
    ray = ray_cluster
    rcfg = RolloutConfig(max_model_len=128, max_new_tokens=16, bucket_mb=1, cpu_kv_cache_mb=32)
    lcfg = LearnerConfig(lora_rank=RANK)
    adapter = ray.remote(num_cpus=0.5)(RolloutWorker).remote(str(tiny_model_dir), rcfg,
                                                             max_lora_rank=lcfg.vllm_max_lora_rank())
    try:
        with engine_pool.lease(tiny_model_dir) as (merged,):
            out = {"adapter": adapter, "merged": merged}
            g = torch.Generator().manual_seed(0)
            seqs = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (5, 17, 40)]
            base = ray.get(out["merged"].prompt_logprobs.remote(seqs))
            yield ray, out, seqs, base
    finally:
        ray.kill(adapter)


@pytest.mark.parametrize(("mode", "zero_stage"), [("adapter", 3), ("merged", 2)])
def test_lora_sync_matches_the_learners_peft_model(engines, tiny_model_dir, zero_stage, mode):
    """Each sync mode and each ZeRO stage once (every case starts 2 learner ranks): the pairing that
    keeps adapter-only sync under ZeRO-3 with gradient checkpointing, the riskiest combination (peft +
    ZeRO-3 + gradient checkpointing: reentrant checkpointing, input grads, adapter gathers that are
    collective). Merged sync goes through the ordinary weight-sync path, under ZeRO-2 here. A sync into
    an engine that already serves an adapter (loaded in place) is the LoRA run below: every step's sync
    is verified against the engine's fingerprints."""
    ray, handles, seqs, base = engines
    engine = handles[mode]
    # A large LR so one step moves the log-probs far beyond the tolerance (lora_B starts at 0).
    # ZeRO-3 also runs with gradient checkpointing: the known peft + ZeRO-3 pitfall (reentrant, input grads).
    cfg = LearnerConfig(num_ranks=2, zero_stage=zero_stage, lr=2e-2, micro_batch_size=2, lora_rank=RANK,
                        lora_alpha=16, lora_sync=mode, gradient_checkpointing=zero_stage == 3)
    ranks = start_ranks(ray, tiny_model_dir, cfg, AlgoConfig())
    try:
        info = ray.get(ranks[0].info.remote())
        assert 0 < info["trainable_params"] < info["total_params"] / 10

        ray.get([w.init_weight_sync.remote([engine], _init_info()) for w in ranks])
        assert not on_all(ray, ranks, "train_step", make_batch(n=8, seed=7))["skipped"]
        version = 10 * zero_stage + (mode == "merged")
        result = on_all(ray, ranks, "sync_weights", version)
        assert result["weight_version"] == version and result["bytes"] > 0
        assert ray.get(engine.get_weight_version.remote()) == str(version)

        after = ray.get(engine.prompt_logprobs.remote(seqs))
        learner = on_all(ray, ranks, "sequence_logprobs", seqs)
        assert max_diff(after, learner) <= TOL
        assert max_diff(after, base) > 100 * TOL  # the step moved the adapter and the engine got it

        adapter = on_all(ray, ranks, "adapter_state_dict")
        adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
        assert all(".lora_A.weight" in k or ".lora_B.weight" in k for k in adapter)
        full_bytes = sum(t.numel() * t.element_size() for t in on_all(ray, ranks, "full_state_dict").values())
        if mode == "adapter":  # only the adapter travelled
            assert result["bytes"] == adapter_bytes < full_bytes / 4
        else:  # the merged model travelled, under plain HF names
            assert result["bytes"] == full_bytes
    finally:
        stop(ray, ranks)


def test_lora_run_reference_from_learner_resume_and_export(tiny_model_dir, ray_cluster, tmp_path):
    """LoRA (adapter mode, beta > 0): no reference actor, sync_bytes a small share of the model, a learner rank
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
    lora = ["learner.lora_rank=4", "algo.beta=0.05", "learner.lr=1e-2", f"reward.functions=[{length}:reward]",
            "checkpoint.every=2", "trainer.max_learner_restarts=1"]
    full = tmp_path / "full"
    trainer = Trainer(config(tiny_model_dir, full, *lora, "trainer.steps=4"))
    killed = kill_while_learning(trainer, at_step=3, role="learner-0")  # training step 4; checkpoint at step 2
    trainer.run()
    assert killed and trainer.learner_restarts == 1
    rows = train_rows(full)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    placement = json.loads((full / "placement.json").read_text())
    assert "reference" not in [p["role"] for p in placement]
    learner0 = next(p for p in placement if p["role"] == "learner-0")
    assert 0 < learner0["trainable_params"] < learner0["total_params"]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert all(0 < r["sync_bytes"] < 0.25 * model_bytes for r in rows)
    assert rows[-1]["kl"] > 0  # the learner's base model (adapters off) served the reference

    # step 3 was logged before the kill and redone after the resume from step 2
    first, again = first_and_redone(full, step=3, steps=[1, 2, 3, 4])
    assert first["reward_mean"] == again["reward_mean"], (first, again)
    assert first["gen_tokens"] == again["gen_tokens"]
    assert first["loss"] == pytest.approx(again["loss"], abs=1e-5)
    assert first["kl"] == pytest.approx(again["kl"], abs=1e-5) and again["kl"] > 0

    out = tmp_path / "export"
    export_checkpoint(sorted((full / "checkpoints").glob("step-*"))[-1], out)
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32),
                                           str(out / "adapter")).eval()
    ids = torch.tensor([[5, 9, 17, 3, 22, 41, 7]])
    with torch.no_grad():
        a, b = merged(input_ids=ids).logits, peft_model(input_ids=ids).logits
        base = model(input_ids=ids).logits
    assert (a - b).abs().max() < 1e-4
    assert (a - base).abs().max() > 1e-3  # the export holds the trained adapter
    # the run's own end-of-run export agrees with the offline one
    assert (full / "hf_model" / "adapter" / "adapter_config.json").is_file()

