"""NCCL ranks per engine (issue 57, item 1): engine i's vLLM workers take ranks 1 + i*TP .. i*TP + TP of a
group of 1 + engines*TP.

The project's own init path runs: the driver's init info (NcclBackend.init_info), the learner's
TrainerInitInfo (TransportBackend.trainer_init_info), the trainer engine the factory names for `nccl`,
OneTripRayClient fanning the init out, and in each engine's workers the receiver vLLM's factory names
for `nccl`, with vLLM's own rank arithmetic (nccl_common.worker_init_process_group). Faked: Ray (the
client's `ray.get` runs the engines' calls in place), vLLM's parallel config (data-parallel index 0,
as every independent engine has) and vLLM's NCCL communicator constructor, replaced by a recorder of
the (rank, world size) each process asks for. The TCPStore rendezvous under it is real (loopback).
In tests/e2e only because it imports vLLM's weight-transfer code; it starts no Ray and no engine.
"""
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from vllm.config.weight_transfer import WeightTransferConfig  # noqa: TID253 (vLLM side)
from vllm.distributed.device_communicators import pynccl  # noqa: TID253 (vLLM side)
from vllm.distributed.weight_transfer.factory import (  # noqa: TID253 (vLLM side)
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)

from actors.transport.client import OneTripRayClient
from actors.transport.nccl import engine_payloads
from actors.transport.nccl_protocol import PEER_ERROR_GRACE_S, NcclWaitAborted
from actors.transport.registry import backend
from learner.weight_sync import DeepSpeedWeightSource  # noqa: TID253 - the learner's source of the weights

ENGINES, TP = 3, 2


class RecordingCommunicator:
    """Stands in for PyNcclCommunicator: records the rank and world size it was built with."""

    made: list[tuple[int, int]] = []
    lock = threading.Lock()

    def __init__(self, group, device):
        with self.lock:
            self.made.append((group.rank, group.world_size))
        self.rank, self.world_size, self.group = group.rank, group.world_size, group

    def destroy(self):
        pass


class FakeEngineHandle:
    """A RolloutWorker as the client sees it: init_weight_transfer_engine.remote(request) reaches each of
    the engine's TP workers as vLLM's worker does (parse_init_info + init_transfer_engine)."""

    def __init__(self, tp: int):
        model = torch.nn.Linear(2, 2)
        self.workers = [WeightTransferEngineFactory.create_engine(
            WeightTransferConfig(backend="nccl"),
            SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_index=0, world_size=tp, rank=r),
                            model_config=None),
            torch.device("cpu"), model) for r in range(tp)]
        self.init_weight_transfer_engine = SimpleNamespace(remote=self._init)

    def _init(self, request):
        def run():  # the engine's workers join together, as vLLM's collective_rpc has them do
            threads = [threading.Thread(target=w.init_transfer_engine, args=(w.parse_init_info(request.init_info),))
                       for w in self.workers]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        return run


@pytest.fixture
def recorded(monkeypatch):
    import ray  # the client's; no cluster is started

    RecordingCommunicator.made = []
    monkeypatch.setattr(pynccl, "PyNcclCommunicator", RecordingCommunicator)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: [r() for r in refs])
    return RecordingCommunicator.made


def test_three_engines_at_tp2_take_ranks_1_to_6_of_a_world_of_7(recorded):
    nccl = backend("nccl")
    nccl.register()
    info = {**nccl.init_info(world_size=1 + ENGINES * TP, bucket_bytes=1 << 20, timeout_s=30.0),
            "master_address": "127.0.0.1"}
    handles = [FakeEngineHandle(TP) for _ in range(ENGINES)]
    source = DeepSpeedWeightSource(torch.nn.Linear(2, 2), zero3=False, is_sender=True)
    client = OneTripRayClient(handles)
    client.timeout_s = 30.0
    trainer = WeightTransferTrainerFactory.trainer_init(nccl.trainer_init_info(info, 0), client=client, source=source)

    assert sorted(recorded) == [(r, 1 + ENGINES * TP) for r in range(1 + ENGINES * TP)]
    by_engine = [[w.model_update_group.rank for w in h.workers] for h in handles]
    assert by_engine == [[1, 2], [3, 4], [5, 6]]
    trainer.shutdown()


def test_a_world_size_that_is_not_engines_times_tp_is_refused_by_name():
    assert engine_payloads({"rank_offset": 1, "world_size": 7}, 3) == [
        {"rank_offset": 1, "world_size": 7}, {"rank_offset": 3, "world_size": 7}, {"rank_offset": 5, "world_size": 7}]
    assert engine_payloads({"rank_offset": None, "world_size": 7}, 3) == [{"rank_offset": None, "world_size": 7}] * 3
    with pytest.raises(ValueError, match="rollout.tensor_parallel_size"):
        engine_payloads({"rank_offset": 1, "world_size": 6}, 3)


def test_an_init_no_engine_answers_ends_at_its_bound_named(recorded):
    """The engines never join (their init call hangs): learner rank 0 gives up after timeout_s, saying so."""
    nccl = backend("nccl")
    nccl.register()
    info = {**nccl.init_info(world_size=3, bucket_bytes=1 << 20, timeout_s=1.0), "master_address": "127.0.0.1"}
    silent = SimpleNamespace(init_weight_transfer_engine=lambda payload: time.sleep(3600))
    source = DeepSpeedWeightSource(torch.nn.Linear(2, 2), zero3=False, is_sender=True)
    t0 = time.monotonic()
    with pytest.raises(NcclWaitAborted, match=r"learner rank 0 \(the weight sender\) (gave up forming|could not open) "
                                              r"the group at 127\.0\.0\.1:\d+"):
        WeightTransferTrainerFactory.trainer_init(nccl.trainer_init_info(info, 0), client=silent, source=source)
    assert time.monotonic() - t0 < 1.0 + PEER_ERROR_GRACE_S + 10  # the margin for a loaded machine; the hang is 3600 s
