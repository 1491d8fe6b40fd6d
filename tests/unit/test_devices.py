"""What "auto" means per device: one rule each, shared by engines, reference, learner ranks and driver."""
import torch

from actors.config import RolloutConfig
from actors.runtime.devices import eager_cpu_engine_env, on_gpu, resolve_dtype, resolve_enforce_eager
from actors.transport.registry import resolve_backend
from actors.transport.vllm_plugin import PACK_ABOVE_ENV, _computes_live
from cluster.config import load_config


def test_auto_dtype_is_bfloat16_on_gpu_float32_on_cpu_and_an_explicit_one_stands():
    assert resolve_dtype("auto", gpu=True) == "bfloat16" and resolve_dtype("auto", gpu=False) == "float32"
    assert resolve_dtype("bfloat16", gpu=False) == "bfloat16" and resolve_dtype("float16", gpu=True) == "float16"


def test_default_enforce_eager_is_eager_on_cpu_and_cuda_graphs_on_gpu():
    assert resolve_enforce_eager(None, gpu=False) is True and resolve_enforce_eager(None, gpu=True) is False
    assert resolve_enforce_eager(True, gpu=True) is True and resolve_enforce_eager(False, gpu=False) is False


def test_enforce_eager_reads_from_yaml_and_overrides():
    assert load_config(None, ["model.path=/x"], validate_paths=False).rollout.enforce_eager is None
    for text, want in (("false", False), ("true", True), ("null", None)):
        cfg = load_config(None, ["model.path=/x", f"rollout.enforce_eager={text}"], validate_paths=False)
        assert cfg.rollout.enforce_eager is want


def test_auto_transfer_backend_follows_the_engines_gpus_not_this_process():
    # the driver may have no GPU while the engines have: only their configured GPUs decide
    assert resolve_backend("auto", engine_gpus=0) == "gloo"
    assert resolve_backend("auto", engine_gpus=1) == "nccl" and resolve_backend("auto", engine_gpus=0.5) == "nccl"
    assert resolve_backend("gloo", engine_gpus=1) == "gloo" and resolve_backend("nccl", engine_gpus=0) == "nccl"


def test_a_process_without_gpus_asked_runs_on_cpu_even_where_gpus_are_visible(monkeypatch):
    # Ray (2.x) no longer hides GPUs from an actor with num_gpus=0: asking decides, not seeing
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not on_gpu(0) and on_gpu(1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not on_gpu(1)


def test_small_float32_cpu_layers_compute_from_the_live_weight(monkeypatch):
    """actors/transport/vllm_plugin.py: which vLLM-CPU layers skip the oneDNN-packed copy (and its re-pack at
    every weight update), per rollout.cpu_pack_above_elements."""
    default = RolloutConfig.cpu_pack_above_elements
    monkeypatch.delenv(PACK_ABOVE_ENV, raising=False)
    assert _computes_live(torch.empty(default // 128, 128))
    assert not _computes_live(torch.empty(default // 128 + 1, 128))
    assert not _computes_live(torch.empty(16, 16, dtype=torch.bfloat16))  # measured for float32 only
    assert not _computes_live(torch.empty(16, 16, 4))  # not a linear weight
    monkeypatch.setenv(PACK_ABOVE_ENV, "0")  # pack every layer, as vLLM does
    assert not _computes_live(torch.empty(2, 2))


def test_an_eager_cpu_engine_runs_vllms_compiled_sampler_functions_eagerly():
    assert eager_cpu_engine_env(None, gpu=False) == {"TORCHDYNAMO_DISABLE": "1"}  # CPU's default: eager
    assert eager_cpu_engine_env(True, gpu=False) == {"TORCHDYNAMO_DISABLE": "1"}
    assert eager_cpu_engine_env(False, gpu=False) == {}  # the user asked vLLM to compile: leave torch.compile on
    assert eager_cpu_engine_env(None, gpu=True) == {} and eager_cpu_engine_env(True, gpu=True) == {}
