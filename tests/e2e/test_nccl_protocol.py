"""The NCCL weight-transfer protocol on CPU (issue 57, items 2 and 7), through a gloo-backed stand-in for
vLLM's NCCL communicator (gloo_nccl.py; its contract with the real class is the last tests here).

What runs is vLLM's own NCCL code, as the project registers it under `nccl`: the sender
(NCCLTrainerWeightTransferEngine.send_weights: metadata check, packed producer) in learner rank 0,
a second learner rank that only iterates its source, and in two forked "engine" processes the receiver
(NCCLWeightTransferEngine: vLLM's rank arithmetic, packed consumer) around a small real torch model. The
project's parts: the init info (NcclBackend), the learner's source and fingerprint (DeepSpeedWeightSource,
Recorder, check), the per-engine payloads (engine_payloads), and the bounded classes (nccl_trainer.py,
nccl_engine.py). Not run: a vLLM engine (the receiver is driven as vLLM's worker drives it: parse, then
update_weights; start/finish_weight_update, vLLM's layerwise reload, need a vLLM model) and Ray (the client
is a pipe per process, which reports a dead process as Ray reports a dead actor).

Bounds shown with the stand-in only: an aborted stand-in returns from its op at once; whether NCCL's
ncclCommAbort frees a kernel spinning on a dead peer as promptly needs two GPUs (not here).
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import multiprocessing
import os
import time
from types import SimpleNamespace

import pytest
import torch
from gloo_nccl import GlooNcclCommunicator, install
from vllm.config.weight_transfer import WeightTransferConfig  # noqa: TID253 (vLLM side)
from vllm.distributed.utils import StatelessProcessGroup  # noqa: TID253 (vLLM side)
from vllm.distributed.weight_transfer.factory import (  # noqa: TID253 (vLLM side)
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine  # noqa: TID253 (vLLM side)
from vllm.model_executor.model_loader import mtp_validation  # noqa: F401,TID253 - see below

from actors.runtime.sockets import free_port
from actors.transport.fingerprint import Recorder, SyncMismatch, check, engine_fingerprint
from actors.transport.gloo_protocol import plan_buckets
from actors.transport.nccl import engine_payloads
from actors.transport.nccl_protocol import NcclWaitAborted
from actors.transport.registry import backend
from learner.weight_sync import DeepSpeedWeightSource  # noqa: TID253 - the learner's source of the weights

# every wait of the transfer (the driver passes trainer.actor_timeout_s): it bounds the healthy steps' joins and
# broadcasts too, which 4 s left a loaded 2-core machine's pauses (three processes and pytest's) too little of
TIMEOUT_S = 8.0
BUCKET_BYTES = 300  # several packed buckets of the small model below
# The children come from a forkserver: a clean process that imported this module once (vLLM, the stand-in),
# so each child starts at once; spawned, each would import vLLM again (~12 s). Forked straight from the
# pytest worker, they inherited the Ray client's threads and signal handlers of the tests run before them in
# that process, and once in CI all three died of SIGSEGV at start. The receiver imports mtp_validation (and
# with it much of vLLM) at its first update: imported above, before the fork, as a vLLM worker has it (an
# engine that imported it inside its bounded receive timed out).
FORK = multiprocessing.get_context("forkserver")
FORK.set_forkserver_preload([__name__])


def as_forked() -> None:
    """What a child needs that the server did not import: the stand-in in place, `nccl` registered."""
    install()
    backend("nccl").register()


class SmallModel(torch.nn.Module):
    """A real torch model; `load_weights` is vLLM's interface (a list of (name, tensor) per packed bucket)."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Parameter(torch.randn(12, 6, generator=g))
        self.proj = torch.nn.Linear(6, 6)
        self.layers = torch.nn.Sequential(*(torch.nn.Linear(6, 6) for _ in range(3)))
        self.norm = torch.nn.Parameter(torch.randn(6, generator=g))
        self.head = torch.nn.Parameter(torch.randn(12, 6, generator=g))
        self.buckets: list[list[str]] = []
        self.die_at_bucket = self.stall_at_bucket = 0

    def load_weights(self, weights):
        self.buckets.append([name for name, _ in weights])
        if len(self.buckets) == self.die_at_bucket:
            os._exit(3)  # the engine dies mid-broadcast, as a killed vLLM worker does
        if len(self.buckets) == self.stall_at_bucket:
            self.stall_at_bucket = 0
            time.sleep(TIMEOUT_S + 1)  # alive, but not reading: a stuck engine
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)


def engine_process(conn) -> None:
    """One engine with one vLLM worker: the receiver vLLM's factory names for `nccl`, driven by commands."""
    as_forked()
    torch.set_num_threads(1)
    model = SmallModel(seed=0)
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_index=0, world_size=1, rank=0),
                                  model_config=None)
    engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="nccl"), vllm_config,
                                                       torch.device("cpu"), model)
    while True:
        command, arg = conn.recv()
        try:
            if command == "class":
                out = (type(engine).__name__, isinstance(engine, NCCLWeightTransferEngine))
            elif command == "init":
                out = engine.init_transfer_engine(engine.parse_init_info(arg))
            elif command == "update":
                model.buckets = []
                engine.update_weights(arg["info"])
                out = {"buckets": model.buckets, "rank": engine.model_update_group.rank,
                       "fingerprint": engine_fingerprint(model, arg["shapes"], arg["version"])}
            elif command in ("die_at_bucket", "stall_at_bucket"):
                setattr(model, command, arg)
            elif command == "corrupt":
                with torch.no_grad():
                    dict(model.named_parameters())[arg].add_(1.0)
            elif command == "fingerprint":
                out = engine_fingerprint(model, arg["shapes"], arg["version"])
            elif command == "live":
                out = GlooNcclCommunicator.live()
            conn.send(("ok", out if command not in ("die_at_bucket", "stall_at_bucket", "corrupt") else None))
        except Exception as e:  # noqa: BLE001 - reported to the test
            conn.send(("error", f"{type(e).__name__}: {e}"))


class EngineDied(RuntimeError):
    pass


class ProcessClient:
    """vLLM's four-call client over engine processes (the role OneTripRayClient plays over Ray actors):
    each engine its own init payload (engine_payloads, as OneTripRayClient), a dead process an error."""

    def __init__(self, count: int, spare: int = 1):
        self.pool = [self._fork() for _ in range(count + spare)]  # forked before any group exists here
        self.engines = self.pool[:count]
        self.payloads: list[dict] = []
        self.reports: list[dict] = []
        self.shapes: dict = {}
        self.version = 0

    @staticmethod
    def _fork():
        parent, child = FORK.Pipe()
        proc = FORK.Process(target=engine_process, args=(child,), daemon=True)
        proc.start()
        return SimpleNamespace(proc=proc, conn=parent, owed=0)

    def restart(self, i: int) -> None:
        """Engine i's process is replaced by a fresh one (a revived engine)."""
        self.engines[i] = next(e for e in self.pool if e not in self.engines and e.proc.is_alive())

    def send(self, i: int, command: str, arg=None) -> None:
        self.engines[i].conn.send((command, arg))
        self.engines[i].owed += 1

    def reply(self, i: int, timeout_s: float = 30.0):
        e, deadline = self.engines[i], time.monotonic() + timeout_s
        while not e.conn.poll(0.02):
            if not e.proc.is_alive():
                raise EngineDied(f"engine {i}: process {e.proc.pid} exited with {e.proc.exitcode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {i} did not answer in {timeout_s}s")
        status, out = e.conn.recv()
        e.owed -= 1
        if status == "error":
            raise RuntimeError(f"engine {i}: {out}")
        return out

    def wait_answered(self, i: int, timeout_s: float) -> None:
        """Until every answer engine i owes has been read (by whichever call waits for it)."""
        deadline = time.monotonic() + timeout_s
        while self.engines[i].owed and time.monotonic() < deadline and self.engines[i].proc.is_alive():
            time.sleep(0.02)
        assert not self.engines[i].owed, f"engine {i}'s answer was never read in {timeout_s}s"

    def call(self, i: int, command: str, arg=None, timeout_s: float = 30.0):
        self.send(i, command, arg)
        return self.reply(i, timeout_s)

    # vLLM's VLLMWeightSyncClient
    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.payloads = engine_payloads(init_info, len(self.engines))
        for i, payload in enumerate(self.payloads):
            self.send(i, "init", payload)
        for i in range(len(self.engines)):
            self.reply(i)

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info) -> None:
        for i in range(len(self.engines)):
            self.send(i, "update", {"info": update_info, "shapes": self.shapes, "version": self.version})
        self.reports = [self.reply(i) for i in range(len(self.engines))]

    def finish_weight_update(self, weight_version=None) -> None:
        pass

    def unfinished(self) -> str | None:
        late = [str(i) for i, e in enumerate(self.engines) if e.owed]
        return f"engine {', '.join(late)} of {len(self.engines)}" if late else None

    def peer_failure(self) -> str | None:
        for i, e in enumerate(self.engines):
            if not e.proc.is_alive():
                return f"engine {i} of {len(self.engines)}: its process {e.proc.pid} exited with {e.proc.exitcode}"
        return None

    def close(self) -> None:
        for e in self.pool:
            if e.proc.is_alive():
                e.proc.kill()
            e.proc.join(5)


def learner_rank_process(conn, init_info: dict) -> None:
    """Learner rank 1: vLLM's trainer engine on a non-sender rank only iterates its source."""
    as_forked()
    source = DeepSpeedWeightSource(SmallModel(seed=1), zero3=False, is_sender=False)
    trainer = WeightTransferTrainerFactory.trainer_init(backend("nccl").trainer_init_info(init_info, 1),
                                                        client=None, source=source)
    trainer.send_weights()
    conn.send((type(trainer).__name__, trainer.model_update_group is None))


@pytest.fixture
def fleet(monkeypatch):
    install(monkeypatch.setattr)
    backend("nccl").register()
    client = ProcessClient(2)
    yield client
    client.close()


def connect(client: ProcessClient, source, info: dict):
    return WeightTransferTrainerFactory.trainer_init(backend("nccl").trainer_init_info(info, 0), client=client,
                                                     source=source)


def send(trainer, client: ProcessClient, source, version: int) -> list[dict]:
    """One update (learner rank 0), its fingerprint reports in check()'s form."""
    source.recorder = client.recorder = Recorder(version)
    client.version, client.shapes = version, {m.name: tuple(m.shape) for m in source.metadata()}
    trainer.send_weights()
    return [{"engine": f"engine {i}", "version": version, "workers": [r["fingerprint"]]}
            for i, r in enumerate(client.reports)]


def test_vllms_nccl_code_across_two_engines_and_two_learner_ranks(fleet):
    learner = SmallModel(seed=1)
    source = DeepSpeedWeightSource(learner, zero3=False, is_sender=True)
    info = {**backend("nccl").init_info(world_size=3, bucket_bytes=BUCKET_BYTES, timeout_s=TIMEOUT_S),
            "master_address": "127.0.0.1"}
    parent, child = FORK.Pipe()
    rank1 = FORK.Process(target=learner_rank_process, args=(child, info), daemon=True)
    rank1.start()
    # vLLM's receiver, bounded. The first answer waits for the engines' start (a loaded machine: minutes), not a bound
    assert fleet.call(0, "class", timeout_s=300) == ("BoundedNcclWeightTransferEngine", True)
    fleet.call(1, "live", timeout_s=300)

    trainer = connect(fleet, source, info)
    # rank 0 bound its own port (the driver's info says 0); each engine its own rank offset
    assert info["master_port"] == 0 and fleet.payloads[0]["master_port"] > 0
    assert [(p["rank_offset"], p["world_size"]) for p in fleet.payloads] == [(1, 3), (2, 3)]

    # 1. bucket order: vLLM's packing rule, the metadata's order, on both engines; the fingerprint holds
    reports = send(trainer, fleet, source, version=1)
    meta = source.metadata()
    sizes = [torch.Size(m.shape).numel() * m.dtype.itemsize for m in meta]
    expected = [[meta[i].name for i in b] for b in plan_buckets(sizes, BUCKET_BYTES)]
    assert len(expected) >= 3 and [r["buckets"] for r in fleet.reports] == [expected, expected]
    assert [r["rank"] for r in fleet.reports] == [1, 2]
    check(source.recorder, reports)
    fleet.call(1, "corrupt", "proj.weight")
    held = [{"engine": f"engine {i}", "version": 1, "workers": [fleet.call(i, "fingerprint", {
        "shapes": fleet.shapes, "version": 1})]} for i in range(2)]
    with pytest.raises(SyncMismatch, match=r"engine 1 does not hold .*proj\.weight"):
        check(source.recorder, held)

    # 2. re-init (a new transfer group): each side's old communicator aborted, none leaked
    trainer.shutdown()
    trainer = connect(fleet, source, info)
    assert [fleet.call(i, "live") for i in range(2)] == [1, 1] and GlooNcclCommunicator.live() == 1
    reports = send(trainer, fleet, source, version=2)
    check(source.recorder, reports)

    # 3. engine 0 alive but stuck in its receive: the sender's wait ends at the bound, naming who was not done
    fleet.call(0, "stall_at_bucket", 1)
    t0 = time.monotonic()
    with pytest.raises(NcclWaitAborted, match=r"learner rank 0 .* aborted the weight broadcast .*"
                                              rf"no answer in {TIMEOUT_S:.0f}s from engine 0"):
        send(trainer, fleet, source, version=3)
    # vLLM's sender waits for the engines' call after its broadcast: that wait is the client's (its own bound)
    assert time.monotonic() - t0 < 2 * TIMEOUT_S + 10  # a margin for a loaded machine, far below a hang
    with contextlib.suppress(RuntimeError):  # engine 1's answer (all buckets in, or aborted at its bound)
        fleet.reply(1, timeout_s=TIMEOUT_S + 10)
    # engine 0's answer (its receive aborted after the stall) is read by the client's call still waiting for it;
    # a new group's init before then would read that stale answer as its own (one full suite, under load)
    fleet.wait_answered(0, timeout_s=TIMEOUT_S + 10)
    trainer.shutdown()
    trainer = connect(fleet, source, info)

    # 4. engine 0 dies mid-broadcast: the sender's wait ends at once, named; engine 1's at its bound
    fleet.call(0, "die_at_bucket", 1)  # engine 1 then waits for buckets the sender never sends
    with torch.no_grad():
        learner.proj.weight.add_(0.5)
    t0 = time.monotonic()
    with pytest.raises(NcclWaitAborted, match=r"learner rank 0 .* aborted the weight broadcast .*engine 0 of 2"):
        send(trainer, fleet, source, version=4)
    sender_s = time.monotonic() - t0
    with pytest.raises(RuntimeError, match=r"engine 1: NcclWaitAborted: .*NCCL rank 2 aborted the receive"):
        fleet.reply(1, timeout_s=TIMEOUT_S + 10)
    engine_s = time.monotonic() - t0
    # engine 1 ends at its own bound; the margin (its start after t0, the abort, the reply) is a loaded machine's
    assert sender_s < TIMEOUT_S and engine_s < TIMEOUT_S + 10, (sender_s, engine_s)
    assert GlooNcclCommunicator.live() == 0 and fleet.call(1, "live") == 0  # both aborted

    # 5. the engine restarted, the group formed again: the update lands, verified, nothing leaked
    fleet.restart(0)
    trainer.shutdown()
    trainer = connect(fleet, source, info)
    reports = send(trainer, fleet, source, version=5)
    check(source.recorder, reports)
    assert [fleet.call(i, "live") for i in range(2)] == [1, 1] and GlooNcclCommunicator.live() == 1
    trainer.shutdown()

    assert parent.poll(30) and parent.recv() == ("BoundedNcclTrainer", True)  # rank 1: no group, its source run
    rank1.join(5)


# ------------------------------------------------------------------ the stand-in's contract with the real class
def test_the_stand_in_takes_and_answers_the_calls_of_vllms_communicator():
    """Same constructor and calls, parameter for parameter (what the NCCL path calls: nccl_common,
    packed_tensor, nccl_protocol.release)."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator  # noqa: TID253 (vLLM side)

    for name in ("__init__", "broadcast", "all_reduce", "destroy"):
        real = list(inspect.signature(getattr(PyNcclCommunicator, name)).parameters)
        assert list(inspect.signature(getattr(GlooNcclCommunicator, name)).parameters) == real, name


def _contract_rank(communicator_class: str, rank: int, port: int, out) -> None:
    """One rank of a group of 2: a broadcast from rank 0, then destroy (the abort) and a broadcast that must
    do nothing. Reports what each step left in the tensor."""
    module, _, name = communicator_class.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    device = torch.device(f"cuda:{rank}") if "pynccl" in module else torch.device("cpu")
    comm = cls(StatelessProcessGroup.create("127.0.0.1", port, rank, 2), device=device)
    t = torch.full((4,), float(rank + 1), device=device)
    comm.broadcast(t, src=0)
    if device.type == "cuda":
        torch.cuda.current_stream().synchronize()
    first = t.cpu().tolist()
    comm.destroy()
    t.fill_(7.0)
    comm.broadcast(t, src=0)  # on an aborted communicator: nothing
    out.put((rank, first, t.cpu().tolist(), comm.disabled))


def _contract_run(communicator_class: str) -> list:
    ctx = multiprocessing.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_contract_rank, args=(communicator_class, r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    return results


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="the real PyNcclCommunicator needs CUDA with 2 devices (NCCL refuses two ranks of one "
                           "group on one device) and vLLM's NCCL library: this machine has no GPU")
def test_the_stand_in_behaves_as_vllms_communicator_where_cuda_exists():
    real = _contract_run("vllm.distributed.device_communicators.pynccl.PyNcclCommunicator")
    standin = _contract_run("gloo_nccl.GlooNcclCommunicator")
    assert real == standin == [(0, [1.0] * 4, [7.0] * 4, True), (1, [1.0] * 4, [7.0] * 4, True)]
