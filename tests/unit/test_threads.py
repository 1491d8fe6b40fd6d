"""The CPU thread budget (cluster/launch/thread_budget.py, actors/runtime/threads.py) and the reference placement
rule (RunConfig.reference_on_learner)."""
from __future__ import annotations

import os

import pytest
import torch

from actors.runtime.threads import node_cores, use_threads
from cluster.config import ConfigError, RunConfig, TrainerConfig, load_config
from cluster.launch.thread_budget import idle_collect_threads, lends_idle_cores, thread_budget
from learner.config import AlgoConfig, LearnerConfig, ReferenceConfig
from learner.forward import model_blocks


def actors(cores: int, node: str = "a", engines: int = 1, ranks: int = 1, reference: bool = False) -> list[dict]:
    out = [{"role": f"rollout-{i}", "node_id": node, "cores": cores} for i in range(engines)]
    out += [{"role": f"learner-{i}", "node_id": node, "cores": cores} for i in range(ranks)]
    return out + ([{"role": "reference", "node_id": node, "cores": cores}] if reference else [])


def test_sync_schedule_gives_each_phase_the_whole_node():
    assert thread_budget("sync", actors(2, reference=True)) == {"rollout-0": 2, "learner-0": 2, "reference": 2}
    # actors of one role share their node's cores: they work at the same time
    assert thread_budget("sync", actors(8, engines=2, ranks=4)) == {
        "rollout-0": 4, "rollout-1": 4, "learner-0": 2, "learner-1": 2, "learner-2": 2, "learner-3": 2}
    assert thread_budget("sync", actors(2, ranks=4))["learner-3"] == 1  # never 0


def test_pipeline_mode_splits_cores_as_async_does_and_lends_none():
    """The engines generate while the learner trains: each side gets its share, not every core (the bench's
    pipeline run had engine, rank and reference at 2 threads each on 2 cores)."""
    for placement in (actors(2, reference=True), actors(16), actors(12, engines=2, ranks=1)):
        assert thread_budget("pipeline", placement) == thread_budget("async", placement)
    assert thread_budget("pipeline", actors(2, reference=True)) != thread_budget("sync", actors(2, reference=True))
    assert idle_collect_threads("pipeline", actors(2, reference=True)) == {}  # its engines are never idle


def test_async_schedule_splits_cores_between_generation_and_learning():
    assert thread_budget("async", actors(2, reference=True)) == {"rollout-0": 1, "learner-0": 1, "reference": 1}
    assert thread_budget("async", actors(16)) == {"rollout-0": 8, "learner-0": 8}
    b = thread_budget("async", actors(12, engines=2, ranks=1))  # in proportion to the actor counts
    assert (b["rollout-0"], b["learner-0"]) == (4, 4)
    assert thread_budget("async", actors(1)) == {"rollout-0": 1, "learner-0": 1}


def test_budget_is_per_node_and_overrides_win():
    placement = actors(4, node="gen", engines=2, ranks=0) + actors(6, node="train", engines=0, ranks=2, reference=True)
    # in async the reference actor collects (after generation) while the ranks train: they split the node
    assert thread_budget("async", placement) == {"rollout-0": 2, "rollout-1": 2, "learner-0": 2, "learner-1": 2,
                                                 "reference": 2}
    assert thread_budget("sync", placement)["reference"] == 6  # sync: one phase at a time
    assert thread_budget("sync", actors(2, reference=True), {"rollout": 1, "learner": 0, "reference": 3}) == {
        "rollout-0": 1, "learner-0": 2, "reference": 3}
    with pytest.raises(ValueError, match="unknown actor role"):
        thread_budget("sync", [{"role": "critic-0", "node_id": "a", "cores": 2}])


def test_idle_collecting_cores_go_to_the_learner_ranks_of_that_node():
    assert idle_collect_threads("async", actors(2, reference=True)) == {"learner-0": 2}
    assert idle_collect_threads("async", actors(8, engines=2, ranks=2)) == {"learner-0": 4, "learner-1": 4}
    assert idle_collect_threads("sync", actors(2, reference=True)) == {}  # every phase has every core already
    assert idle_collect_threads("async", actors(2), {"learner": 1}) == {}  # the user's count stands
    # ranks on a node of their own have all its cores already; nothing to lend across nodes
    placement = actors(4, node="gen", engines=2, ranks=0) + actors(6, node="train", engines=0, ranks=2)
    assert idle_collect_threads("async", placement) == {}


def test_only_cpu_async_learners_without_a_thread_override_are_lent_cores():
    cfg = RunConfig()
    cfg.trainer.mode = "async"
    assert lends_idle_cores(cfg)
    cfg.learner.num_gpus = 1.0  # a GPU rank computes on its device, and has no "lend" group
    assert not lends_idle_cores(cfg)
    cfg.learner.num_gpus, cfg.learner.threads = 0.0, 1
    assert not lends_idle_cores(cfg)
    cfg.learner.threads, cfg.trainer.mode = 0, "sync"
    assert not lends_idle_cores(cfg)


def test_use_threads_goes_around_a_patched_set_num_threads(monkeypatch):
    """vLLM's CPU worker replaces torch.set_num_threads with a no-op; the budget must still apply."""
    before = torch.get_num_threads()
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    try:
        use_threads(2 if before != 2 else 1)
        assert torch.get_num_threads() == (2 if before != 2 else 1)
        use_threads(0)  # 0: leave as it is
        assert torch.get_num_threads() == (2 if before != 2 else 1)
    finally:
        use_threads(before)
    assert 1 <= node_cores() <= os.cpu_count()


def test_thread_and_placement_keys_are_validated():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rollout.threads=-1", "learner.threads=-2", "reference.threads=-1",
                           "reference.placement=gpu"])
    text = str(e.value)
    for key in ("rollout.threads", "learner.threads", "reference.threads", "reference.placement must be auto|actor|learner"):
        assert key in text


def on_learner(beta: float = 0.01, placement: str = "auto", mode: str = "sync", **learner) -> bool:
    return RunConfig(algo=AlgoConfig(beta=beta), reference=ReferenceConfig(placement=placement),
                     trainer=TrainerConfig(mode=mode), learner=LearnerConfig(**learner)).reference_on_learner()


def test_reference_placement_auto_is_learner_on_cpu_and_actor_on_gpu():
    assert on_learner()  # CPU learner, sync schedule: the frozen copy on the ranks
    assert not on_learner(mode="async")  # async: the actor's pass overlaps training
    assert not on_learner(num_gpus=1)  # a GPU learner: keep its memory for training
    assert on_learner(placement="learner", num_gpus=1)
    assert not on_learner(placement="actor")
    assert not on_learner(beta=0)  # no KL term, no reference anywhere


def test_reference_placement_with_lora():
    assert on_learner(lora_rank=4, num_gpus=1)  # the base model is already there: adapters off
    assert on_learner(lora_rank=4, mode="async")
    assert not on_learner(beta=0, lora_rank=4)
    assert not on_learner(lora_rank=4, lora_reference_actor=True)
    assert not on_learner(placement="actor", lora_rank=4)


def test_lent_threads_are_taken_at_every_block_of_any_architecture():
    """The per-block check for lent threads finds the blocks by what transformers says they are
    (`_no_split_modules`), so GPT-2's and GPT-NeoX's blocks count too, not only *DecoderLayer classes;
    inside a peft wrapper as well."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM, Qwen2Config, Qwen2ForCausalLM

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    neox = GPTNeoXForCausalLM(GPTNeoXConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                            intermediate_size=64, vocab_size=64))
    qwen = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=2,
                                        num_key_value_heads=1, intermediate_size=128, vocab_size=64))
    assert [type(b).__name__ for b in model_blocks(gpt2)] == ["GPT2Block"] * 3
    assert [type(b).__name__ for b in model_blocks(neox)] == ["GPTNeoXLayer"] * 2
    assert [type(b).__name__ for b in model_blocks(qwen)] == ["Qwen2DecoderLayer"] * 2
    lora = get_peft_model(qwen, LoraConfig(r=2, target_modules=["q_proj"]))
    assert [type(b).__name__ for b in model_blocks(lora)] == ["Qwen2DecoderLayer"] * 2


def test_a_reward_model_actor_is_budgeted_like_the_reference():
    placement = actors(2, reference=True) + [{"role": "reward-0", "node_id": "a", "cores": 2}]
    assert thread_budget("sync", placement)["reward-0"] == 2  # its phase has the node's cores
    assert thread_budget("async", placement)["reward-0"] == 1  # collecting side, beside the learner
    alone = actors(2, engines=0, ranks=1) + [{"role": "reward-0", "node_id": "a", "cores": 2}]
    assert thread_budget("async", alone) == {"learner-0": 1, "reward-0": 1}
