"""The weight-transport registry (actors/transport/registry.py): one list of backends that the config
check, the driver's init info, the learner and the vLLM plugin all read."""
import pytest

from actors.config import RolloutConfig
from actors.transport.registry import BACKENDS, backend


def test_the_config_accepts_exactly_auto_and_the_registered_backends():
    assert list(BACKENDS) == ["gloo", "nccl"]
    for name in ("auto", *BACKENDS):
        assert not [p for p in RolloutConfig(weight_transfer_backend=name).problems() if "weight_transfer" in p]
    assert RolloutConfig(weight_transfer_backend="ipc").problems() == [
        "rollout.weight_transfer_backend must be auto|gloo|nccl, got 'ipc'"]


def test_each_backend_gives_the_driver_its_init_info():
    gloo = backend("gloo").init_info(world_size=3, bucket_bytes=1 << 20, timeout_s=60.0)
    assert gloo == {"master_address": "", "master_port": 0, "world_size": 3, "bucket_bytes": 1 << 20, "timeout_s": 60.0}
    nccl = backend("nccl").init_info(world_size=3, bucket_bytes=1 << 20, timeout_s=60.0)
    # port 0: learner rank 0 binds its own, on its own node (the driver's host may be another)
    assert nccl["master_port"] == 0 and nccl["world_size"] == 3 and nccl["timeout_s"] == 60.0
    assert (nccl["packed"], nccl["packed_buffer_size_bytes"]) == (True, 1 << 20)
    assert [backend(n).engine_config() for n in BACKENDS] == [{"backend": "gloo"}, {"backend": "nccl"}]


def test_an_unknown_backend_is_named_with_the_known_ones():
    with pytest.raises(ValueError, match=r"'ipc'; known: gloo, nccl"):
        backend("ipc")
