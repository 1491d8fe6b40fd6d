"""The gloo weight-transfer backend in isolation: no vLLM engine, no Ray. In tests/e2e because it
imports vLLM's weight-transfer interfaces (the backend is built on them), which the unit tier does not.

The trainer side runs in the test's thread; each "engine" is a GlooWeightTransferEngine
around a stand-in model that records what `load_weights` received, driven by a client that,
like RayVLLMWeightSyncClient, fans each call out to every engine concurrently.
"""
from __future__ import annotations

import datetime
import importlib
import os
import threading as th
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (  # noqa: TID253 (vLLM side)
    ModuleSource,
    WeightTransferEngine,
    WeightTransferInitRequest,
)
from vllm.distributed.weight_transfer.factory import (  # noqa: TID253 (vLLM side)
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)

import actors.transport.vllm_plugin
from actors.runtime.process_groups import new_gloo_group
from actors.transport import gloo_trainer, shared_memory  # noqa: TID253 - the gloo backend under test
from actors.transport.gloo_engine import GlooWeightTransferEngine
from actors.transport.gloo_protocol import BucketBuffers, pipeline_bucket_bytes, plan_buckets
from actors.transport.gloo_trainer import (  # noqa: TID253 - the gloo backend under test
    GlooTrainerInitInfo,
    GlooTrainerWeightTransferEngine,
)
from actors.transport.registry import backend


class RecordingModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.received: dict[str, torch.Tensor] = {}
        self.calls = 0

    def load_weights(self, weights):
        self.calls += 1
        for name, tensor in weights:
            self.received[name] = tensor.clone()  # the tensors are views of a reused buffer


def make_engine() -> GlooWeightTransferEngine:
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_index=0, world_size=1, rank=0),
                                  model_config=None)
    return GlooWeightTransferEngine(SimpleNamespace(backend="gloo"), vllm_config, torch.device("cpu"),
                                    RecordingModel())


class FanOutClient:
    """The four-method client protocol over local engines, each call concurrent on all."""

    def __init__(self, engines):
        self.engines = engines
        self.pool = ThreadPoolExecutor(max_workers=len(engines))
        self.finished = 0
        self.versions = []

    def _all(self, fn):
        for f in [self.pool.submit(fn, e) for e in self.engines]:
            f.result()

    def init_weight_transfer_engine(self, init_info):
        # Engines receive the request the way vLLM's worker does: parse, then init.
        request = WeightTransferInitRequest(init_info=init_info)
        self._all(lambda e: e.init_transfer_engine(e.parse_init_info(request.init_info)))

    def start_weight_update(self):
        self._all(lambda e: e.start_weight_update())

    def update_weights(self, update_info):
        self._all(lambda e: e.update_weights(update_info))

    def finish_weight_update(self, weight_version=None):
        self._all(lambda e: e.finish_weight_update())
        self.finished += 1
        self.versions.append(weight_version)


class TinyNet(torch.nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Parameter(torch.randn(50, 16, generator=g))
        self.layers = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(3)])
        self.scale = torch.nn.Parameter(torch.tensor(2.5))  # 0-dim
        self.bf16 = torch.nn.Parameter(torch.randn(7, 3, generator=g).to(torch.bfloat16))  # another dtype
        with torch.no_grad():
            for layer in self.layers:
                layer.weight.copy_(torch.randn(16, 16, generator=g))


def test_plan_buckets_matches_pack_rule():
    assert plan_buckets([], 10) == []
    assert plan_buckets([4, 4, 4], 10) == [[0, 1, 2]]
    assert plan_buckets([6, 6, 6], 10) == [[0, 1], [2]]  # a bucket closes once it holds more than 10
    assert plan_buckets([30, 1], 10) == [[0], [1]]  # a tensor larger than a bucket travels alone


@pytest.mark.parametrize("shared", [True, False], ids=["shared_memory", "broadcast"])
@pytest.mark.parametrize("num_engines,bucket_bytes", [(1, 1 << 20), (2, 700)])
def test_weights_arrive_identical(num_engines, bucket_bytes, shared):
    engines = [make_engine() for _ in range(num_engines)]
    client = FanOutClient(engines)
    net = TinyNet()
    init = GlooTrainerInitInfo(master_address="127.0.0.1", master_port=0, world_size=1 + num_engines,
                               bucket_bytes=bucket_bytes, timeout_s=60, rank=0, shared_memory=shared)
    # Through vLLM's factory, as the learner will call it.
    trainer = WeightTransferTrainerFactory.trainer_init(init, client=client, source=ModuleSource(net))
    assert isinstance(trainer, GlooTrainerWeightTransferEngine)
    # One machine: every engine maps the segment, so it is used when offered.
    assert trainer.transport() == ("shared_memory" if shared else "gloo") and trainer.refused == []
    assert sorted(e.rank for e in engines) == list(range(1, 1 + num_engines))
    trainer.send_weights(weight_version=3)
    expected = dict(net.named_parameters())
    for engine in engines:
        got = engine.model.received
        assert set(got) == set(expected)
        for name, param in expected.items():
            assert got[name].dtype == param.dtype and got[name].shape == param.shape, name
            assert torch.equal(got[name], param.detach()), name
        if bucket_bytes < 1000:
            assert engine.model.calls > 1  # really split into several buckets
    assert client.versions == ["3"]

    # A second round sends the new values (the engines keep their group).
    with torch.no_grad():
        net.scale.add_(1.0)
    trainer.send_weights()
    for engine in engines:
        assert float(engine.model.received["scale"]) == pytest.approx(3.5)
    trainer.shutdown()
    for engine in engines:
        engine.shutdown()


def test_a_broadcast_update_goes_in_about_eight_buckets_within_bounds():
    """Each side works on one bucket while the next travels, so an update is cut in ~8 (one 64 MiB
    bucket made the sender pack, the wire carry and the engine load one after another)."""
    assert pipeline_bucket_bytes(50 << 20, 64 << 20) == (50 << 20) // 8
    assert pipeline_bucket_bytes(3 << 20, 64 << 20) == 1 << 20  # not below 1 MiB: per-bucket costs
    assert pipeline_bucket_bytes(50 << 20, 2 << 20) == 2 << 20  # never above the configured bucket_bytes
    assert pipeline_bucket_bytes(100, 700) == 700  # a tiny update in tiny buckets: as configured


def test_bucket_buffers_rotate_and_are_kept():
    buffers = BucketBuffers(2)
    a, b, c = buffers.take(10), buffers.take(4), buffers.take(8)
    assert (a.numel(), b.numel(), c.numel()) == (10, 4, 8)
    assert c.data_ptr() == a.data_ptr() and b.data_ptr() != a.data_ptr()  # the third call gets the first buffer
    assert buffers.take(100).numel() == 100  # a larger bucket grows the buffer


@pytest.mark.parametrize("shared", [True, False], ids=["shared_memory", "broadcast"])
def test_every_round_sends_every_bucket_new(shared):
    """Three rounds, several buckets, all values changed each round: the kept buffers (or the one
    shared segment) never mix buckets or rounds."""
    engine = make_engine()
    net = TinyNet()
    init = GlooTrainerInitInfo(master_address="127.0.0.1", master_port=0, world_size=2,
                               bucket_bytes=700, timeout_s=60, rank=0, shared_memory=shared)
    trainer = WeightTransferTrainerFactory.trainer_init(init, client=FanOutClient([engine]), source=ModuleSource(net))
    for round_ in range(3):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(round_ + 1)
        trainer.send_weights()
        for name, param in net.named_parameters():
            assert torch.equal(engine.model.received[name], param.detach()), (round_, name)
    trainer.shutdown()
    engine.shutdown()


def test_reinit_replaces_previous_group():
    """A new trainer_init (e.g. after a rollout worker restarted) must work on engines that
    still hold the previous group."""
    engines = [make_engine()]
    client = FanOutClient(engines)
    net = TinyNet(seed=1)
    for round_ in range(2):
        init = GlooTrainerInitInfo(master_address="127.0.0.1", master_port=0, world_size=2, timeout_s=60, rank=0)
        trainer = GlooTrainerWeightTransferEngine.trainer_init(init, client=client, source=ModuleSource(net))
        with torch.no_grad():
            net.scale.fill_(10.0 + round_)
        trainer.send_weights()
        assert float(engines[0].model.received["scale"]) == 10.0 + round_
        trainer.shutdown()  # the engine side is not told: its next init must tear its group down
    engines[0].shutdown()


def test_non_sender_rank_only_iterates_the_source():
    class CountingSource(ModuleSource):
        passes = 0

        def __iter__(self):
            CountingSource.passes += 1
            yield from super().__iter__()

    class NoClient:
        def __getattr__(self, name):
            raise AssertionError(f"a non-sender rank called client.{name}")

    init = GlooTrainerInitInfo(master_address="127.0.0.1", master_port=0, world_size=2, rank=1)
    trainer = GlooTrainerWeightTransferEngine.trainer_init(init, client=NoClient(), source=CountingSource(TinyNet()))
    trainer.send_weights()
    assert CountingSource.passes == 1


def test_world_size_too_small_is_a_clear_error():
    engines = [make_engine(), make_engine()]
    init = GlooTrainerInitInfo(master_address="127.0.0.1", master_port=0, world_size=2, timeout_s=20, rank=0)
    with pytest.raises(ValueError, match="world_size"):
        GlooTrainerWeightTransferEngine.trainer_init(init, client=FanOutClient(engines), source=ModuleSource(TinyNet()))


def test_source_that_disagrees_with_its_metadata_fails_fast():
    class LyingSource(ModuleSource):
        def __iter__(self):
            for name, t in super().__iter__():
                yield name, t.reshape(-1) if name == "embed" else t  # metadata() said [50, 16]

    engines = [make_engine()]
    init = GlooTrainerInitInfo(master_address="127.0.0.1", master_port=0, world_size=2, timeout_s=60, rank=0)
    trainer = GlooTrainerWeightTransferEngine.trainer_init(init, client=FanOutClient(engines),
                                                           source=LyingSource(TinyNet()))
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="disagrees with metadata"):
        trainer.send_weights()
    assert time.monotonic() - t0 < 30
    engines[0].shutdown()


def test_backends_registered():
    actors.transport.vllm_plugin.register()
    actors.transport.vllm_plugin.register()  # idempotent
    assert WeightTransferEngineFactory._registry["gloo"]() is GlooWeightTransferEngine
    assert "gloo" in WeightTransferTrainerFactory._registry


def test_explicit_rank_offset():
    """A payload with rank_offset (the NCCL convention) places the worker at offset + its rank."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    engine = make_engine()
    payload = dict(master_address="127.0.0.1", master_port=store.port, world_size=3, generation="g",
                   rank_offset=2, timeout_s=30)
    t = th.Thread(target=lambda: engine.init_transfer_engine(engine.parse_init_info(payload)))
    t.start()
    groups = {}

    def join(rank):  # each rank with its own store client, as in separate processes
        client = store if rank == 0 else dist.TCPStore("127.0.0.1", store.port, is_master=False)
        groups[rank] = new_gloo_group(dist.PrefixStore("raygrpo/g/", client), rank, 3, "127.0.0.1", 30)

    joiners = [th.Thread(target=join, args=(r,)) for r in (0, 1)]
    for j in joiners:
        j.start()
    for j in [t, *joiners]:
        j.join(60)
    assert engine.rank == 2 and engine.group is not None and set(groups) == {0, 1}
    engine.shutdown()


def test_shared_segment_is_unlinked_after_init_and_refusals_fall_back_to_gloo(monkeypatch):
    """The segment's file is gone once the engines answered (nothing left in /dev/shm whatever
    happens later); an engine that cannot map it (another machine) makes every update go by gloo,
    and the sender says why."""
    created = []
    real_create = shared_memory.create_segment

    def recording_create(nbytes):
        segment = real_create(nbytes)
        created.append(segment[0])
        return segment

    monkeypatch.setattr(shared_memory, "create_segment", recording_create)
    monkeypatch.setattr(shared_memory, "attach_segment", lambda *a: (None, "test: on another machine"))
    engine = make_engine()
    net = TinyNet()
    init = GlooTrainerInitInfo(master_address="127.0.0.1", master_port=0, world_size=2, bucket_bytes=700,
                               timeout_s=60, rank=0)
    trainer = GlooTrainerWeightTransferEngine.trainer_init(init, client=FanOutClient([engine]), source=ModuleSource(net))
    assert len(created) == 1 and not os.path.exists(created[0])
    assert trainer.transport() == "gloo" and trainer.refused == ["test: on another machine"]
    trainer.send_weights()
    for name, param in net.named_parameters():
        assert torch.equal(engine.model.received[name], param.detach()), name
    trainer.shutdown()
    engine.shutdown()


def test_attach_checks_the_nonce_and_size():
    path, nonce, tensor = shared_memory.create_segment(1000)
    try:
        mapped, why = shared_memory.attach_segment(path, 1000, nonce)
        assert why == "" and mapped is not None
        tensor[100:104] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)  # one memory: the engine sees the write
        assert mapped[100:104].tolist() == [1, 2, 3, 4]
        assert shared_memory.attach_segment(path, 1000, "00" * 16)[1].endswith("(another machine)")
        assert "another size" in shared_memory.attach_segment(path, 999, nonce)[1]
    finally:
        shared_memory.unlink(path)
    assert shared_memory.attach_segment(path, 1000, nonce)[0] is None  # gone


def test_no_segment_when_shm_is_too_small(monkeypatch):
    monkeypatch.setattr(shared_memory, "MAX_SHARE_OF_FREE", 0.0)
    assert shared_memory.create_segment(1 << 20) is None


class OneCallClient(FanOutClient):
    """Like learner/weight_sync.py OneTripRayClient: one call per engine runs the whole update
    (start, receive, finish) and does not block the sender."""

    def start_weight_update(self):
        pass

    def finish_weight_update(self, weight_version=None):
        pass

    def submit_update_weights(self, update_info):
        def whole_update(engine):
            engine.start_weight_update()
            engine.update_weights(update_info)
            engine.finish_weight_update()

        return PendingCalls([self.pool.submit(whole_update, e) for e in self.engines])


class PendingCalls:
    def __init__(self, futures):
        self.futures = futures

    def raise_if_failed(self):
        for f in self.futures:
            if f.done():
                f.result()

    def join(self, timeout_s):
        for f in self.futures:
            f.result(timeout_s)


@pytest.mark.parametrize("shared", [True, False], ids=["shared_memory", "broadcast"])
def test_engine_failing_mid_update_fails_the_sender_at_once(shared):
    """An engine whose load fails after the first bucket closes its group, so the sender, waiting
    on the next bucket, raises the engine's own error at once (it used to sit out the gloo
    timeout, 600 s by default), and a new init works again."""
    class Failing(Exception):
        pass

    def refuse(weights):
        raise Failing("load_weights refused")

    engine = make_engine()
    net = TinyNet()
    real_load = engine.model.load_weights
    engine.model.load_weights = refuse
    init = GlooTrainerInitInfo(master_address="127.0.0.1", master_port=0, world_size=2, bucket_bytes=700,
                               timeout_s=60, rank=0, shared_memory=shared)
    trainer = GlooTrainerWeightTransferEngine.trainer_init(init, client=OneCallClient([engine]), source=ModuleSource(net))
    t0 = time.monotonic()
    with pytest.raises(Failing, match="refused"):
        trainer.send_weights()
    assert time.monotonic() - t0 < 30  # not the gloo timeout
    assert engine.group is None and trainer.group is None  # both sides closed; the caller inits again

    engine.model.load_weights = real_load
    trainer = GlooTrainerWeightTransferEngine.trainer_init(init, client=OneCallClient([engine]), source=ModuleSource(net))
    trainer.send_weights()
    for name, param in net.named_parameters():
        assert torch.equal(engine.model.received[name], param.detach()), name
    trainer.shutdown()
    engine.shutdown()


@pytest.mark.parametrize("shared", [True, False], ids=["shared_memory", "broadcast"])
def test_a_sender_that_gives_up_frees_every_engine_at_once(shared):
    """One engine of two fails mid-update with its sockets left open and silent (its host vanished); the
    sender raises and gives up. The other engine, waiting on a bucket that will never come, must end its
    update call at once, not at the gloo timeout: until it does, its actor answers nothing (the driver
    waited 600 s on it after a host was lost, CI 2026-11-26). Neither side may block dropping its group
    (ProcessGroupGloo's destructor waits for the ops in flight: gloo_protocol.TrackedGroup)."""
    class Failing(Exception):
        pass

    def refuse(weights):
        raise Failing("load_weights refused")

    timeout_s = 10  # the group's gloo timeout: the ops left in flight end by then
    engines = [make_engine(), make_engine()]
    client = OneCallClient(engines)
    init = GlooTrainerInitInfo(master_address="127.0.0.1", master_port=0, world_size=3, bucket_bytes=700,
                               timeout_s=timeout_s, rank=0, shared_memory=shared)
    trainer = GlooTrainerWeightTransferEngine.trainer_init(init, client=client, source=ModuleSource(TinyNet()))
    failing = next(e for e in engines if e.rank == 1)
    failing.model.load_weights = refuse
    failing.shutdown = lambda: None  # its group's sockets stay open and silent, as a host that vanished leaves them
    calls = []
    submit = client.submit_update_weights
    client.submit_update_weights = lambda info: calls.append(submit(info)) or calls[-1]
    t0 = time.monotonic()
    with pytest.raises(Failing, match="refused"):  # the traceback (and its gloo work) is kept, as a learner's is
        trainer.send_weights()
    healthy = next(e for e in engines if e.rank == 2)
    with pytest.raises(RuntimeError, match="gave up"):
        calls[0].futures[engines.index(healthy)].result(timeout=timeout_s)
    assert time.monotonic() - t0 < timeout_s / 2  # not the gloo timeout
    assert healthy.group is None and trainer.group is None
    # The groups released with ops in flight go once those ops end (at the timeout): none outlives the test.
    del failing.shutdown
    failing.shutdown()
    for thread in [t for t in th.enumerate() if t.name == "gloo-group-release"]:
        thread.join(timeout_s + 10)
        assert not thread.is_alive()


def test_the_vllm_plugin_registers_our_backend_and_the_trainer_init_info_resolves():
    """The registry's gloo entry, as vLLM's factories see it once the plugin has run."""
    actors.transport.vllm_plugin.register()
    actors.transport.vllm_plugin.register()  # vLLM may call a plugin more than once
    assert "gloo" in WeightTransferEngineFactory._registry and "gloo" in WeightTransferTrainerFactory._registry
    info = backend("gloo").trainer_init_info(
        {"master_address": "127.0.0.1", "master_port": 0, "world_size": 2, "bucket_bytes": 1 << 20, "timeout_s": 5.0},
        rank=0)
    assert isinstance(info, GlooTrainerInitInfo) and info.is_sender and info.world_size == 2


def test_gloo_engine_class_named_for_vllm_resolves():
    """vLLM's lazy engine factory imports the engine class by name in the engine's process: the name resolves."""
    cls = getattr(importlib.import_module(gloo_trainer.ENGINE_MODULE), gloo_trainer.ENGINE_CLASS)
    assert issubclass(cls, WeightTransferEngine) and cls.__name__ == gloo_trainer.ENGINE_CLASS
