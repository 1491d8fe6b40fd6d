"""raygrpo plan's memory model (cluster/plan/memory.py) against DeepSpeed's own estimators.

DeepSpeed's `estimate_zero2/3_model_states_mem_needs_all_cold` print a table from
`estimate_zero2/3_model_states_mem_needs`, which return (host bytes, device bytes); the host side there
carries a 1.5x buffer factor (`additional_buffer_factor`), our model states the bytes themselves.
"""
import contextlib
import io
import re

import pytest

from cluster.plan.memory import LearnerLayout, engine_memory, learner_memory
from cluster.plan.shapes import PUBLISHED

BUFFER = 1.5  # DeepSpeed's default additional_buffer_factor (host side only)


def _layout(ranks, stage, offload=False, offload_params=False):
    return LearnerLayout(ranks=ranks, zero_stage=stage, dtype_bytes=2, micro_batch=1, seq_len=1, completion_len=1,
                         offload_optimizer=offload, offload_params=offload_params)


@pytest.mark.parametrize("model", ["Qwen2.5-7B", "Llama-3.1-8B-Instruct", "SmolLM2-135M-Instruct"])
@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("offload", [False, True])
def test_zero2_states_match_deepspeed(model, ranks, offload):
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    shape = PUBLISHED[model]
    p = shape.params()
    cpu, gpu = estimate_zero2_model_states_mem_needs(p, num_gpus_per_node=ranks, cpu_offload=offload)
    mem = learner_memory(shape, _layout(ranks, 2, offload))
    assert mem.states == pytest.approx(gpu, abs=ranks)  # DeepSpeed rounds 18P/N down to an int
    if offload:  # the offloaded optimizer of every rank of the node, on its host
        assert mem.host * BUFFER == pytest.approx(cpu)


@pytest.mark.parametrize("model", ["Qwen2.5-7B", "Qwen3-4B"])
@pytest.mark.parametrize("ranks", [1, 2, 8])
@pytest.mark.parametrize("offload,offload_params", [(False, False), (True, False), (True, True)])
def test_zero3_states_match_deepspeed(model, ranks, offload, offload_params):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    shape = PUBLISHED[model]
    p, largest = shape.params(), shape.largest_leaf_params()
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(p, largest, num_gpus_per_node=ranks, cpu_offload=offload,
                                                          cpu_offload_params=offload_params, zero_init=True)
    mem = learner_memory(shape, _layout(ranks, 3, offload, offload_params))
    assert mem.states == pytest.approx(gpu, abs=ranks)
    if offload:
        assert mem.host * BUFFER == pytest.approx(cpu)


def test_the_all_cold_tables_print_the_same_device_figures():
    """DeepSpeed's all-cold estimators print GiB with two decimals; our figures round to what they print."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_cold

    shape = PUBLISHED["Qwen2.5-7B"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        estimate_zero2_model_states_mem_needs_all_cold(shape.params(), num_gpus_per_node=8)
        estimate_zero3_model_states_mem_needs_all_cold(shape.params(), shape.largest_leaf_params(), num_gpus_per_node=8)
    rows = {opts.strip(): float(gpu) for gpu, opts in re.findall(r"GB \|\s*([\d.]+)GB \| (.*)", out.getvalue())}
    z2 = learner_memory(shape, _layout(8, 2)).states / 2**30
    z3 = learner_memory(shape, _layout(8, 3)).states / 2**30
    assert rows["offload_optimizer=none"] == pytest.approx(z2, abs=0.006)
    assert rows["offload_param=none, offload_optimizer=none, zero_init=1"] == pytest.approx(z3, abs=0.006)


def test_stages_order_and_checkpointing_shrinks_activations():
    shape = PUBLISHED["Qwen2.5-7B"]
    states = [learner_memory(shape, _layout(8, s)).states for s in (0, 1, 2, 3)]
    assert states == sorted(states, reverse=True) and states[0] > 2 * states[3]
    full = LearnerLayout(8, 2, 2, micro_batch=4, seq_len=4096, completion_len=2048)
    ckpt = LearnerLayout(8, 2, 2, micro_batch=4, seq_len=4096, completion_len=2048, gradient_checkpointing=True)
    a_full, a_ckpt = learner_memory(shape, full).activations, learner_memory(shape, ckpt).activations
    assert a_ckpt < a_full / 10
    # activations are linear in the micro-batch
    double = LearnerLayout(8, 2, 2, micro_batch=8, seq_len=4096, completion_len=2048)
    assert learner_memory(shape, double).activations == pytest.approx(2 * a_full)


def test_float32_training_keeps_no_16_bit_copies():
    """On CPU (float32) stage 0 is params + grads + Adam: 16 bytes a parameter."""
    shape = PUBLISHED["SmolLM2-135M-Instruct"]
    lay = LearnerLayout(1, 0, 4, micro_batch=1, seq_len=1, completion_len=1)
    assert learner_memory(shape, lay).states == 16 * shape.params()


def test_engine_kv_cache_is_what_the_budget_leaves():
    shape = PUBLISHED["Qwen2.5-7B"]
    e = engine_memory(shape, 80e9, 0.85, 1, 2, 4096, 100, 2048)
    assert e.kv_cache == pytest.approx(0.85 * 80e9 - e.weights - e.activation_peak - e.overhead)
    assert e.weights == pytest.approx(2 * shape.params())
    assert e.kv_needed_one == 4096 * 2 * 28 * 4 * 128 * 2  # 2 x layers x kv_heads x head_dim x bf16 per token
    assert e.starts
    low = engine_memory(shape, 80e9, 0.1, 1, 2, 4096, 100, 2048)  # the default 0.1: 8 GB, under 15 GB of weights
    assert not low.starts
    tp2 = engine_memory(shape, 80e9, 0.1, 2, 2, 4096, 100, 2048)
    assert tp2.weights == pytest.approx(e.weights / 2)
