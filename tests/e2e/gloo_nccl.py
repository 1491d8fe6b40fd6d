"""A gloo-backed stand-in for vLLM's NCCL communicator (`PyNcclCommunicator`), for the NCCL weight-transfer
path on a machine without CUDA (issue 57, item 2). Not a test module: test_nccl_protocol.py uses it.

Same constructor (a StatelessProcessGroup and a device), same calls (`broadcast`, `all_reduce`, `destroy`,
`rank`, `world_size`, `available`, `disabled`, `device`, `group`), and the semantics the project relies on:

- the group forms over the StatelessProcessGroup's TCPStore (rank 0 serves it), like ncclCommInitRank over
  the unique id vLLM broadcasts through that store, with the same 1-element all_reduce warm-up;
- a call on a destroyed (aborted) communicator returns at once and does nothing (pynccl.py: `if
  self.disabled: return`);
- `destroy()` is an abort (vLLM 0.32's is ncclCommAbort): an op in flight on another thread returns, its
  buffer not filled, as a host thread blocked on an aborted NCCL kernel does;
- ops are synchronous (a real broadcast is enqueued, and the host waits in a stream synchronize: the
  same blocking seen from the caller's thread).

What it cannot show: NCCL's own hangs (a kernel spinning on a peer that vanished) and whether
ncclCommAbort really frees them; GPU streams (`install` replaces them with no-ops for vLLM's packed
producer/consumer). test_nccl_protocol.py's contract test holds the interface to the real class here and
its behaviour where CUDA and two devices exist.

`GlooNcclCommunicator.live()`: the communicators of this process not destroyed (a leak shows there).
"""
from __future__ import annotations

import contextlib
import datetime
import threading
import time

import torch
import torch.distributed as dist

OP_TIMEOUT_S = 600.0  # gloo's own bound; the project's watchdog ends waits long before it


class GlooNcclCommunicator:
    _live: set[int] = set()
    _lock = threading.Lock()

    def __init__(self, group, device, library_path: str | None = None):
        self.group, self.rank, self.world_size = group, group.rank, group.world_size
        self.device = torch.device("cpu")
        self.available, self.disabled = self.world_size > 1, self.world_size <= 1
        self._works: list = []
        if self.disabled:
            return
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=OP_TIMEOUT_S)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        generation = group.broadcast_obj(str(time.monotonic_ns()) if self.rank == 0 else None, src=0)
        store = dist.PrefixStore(f"gloo-nccl/{generation}/", group.store)
        self._pg = dist.ProcessGroupGloo(store, self.rank, self.world_size, opts)
        with self._lock:
            self._live.add(id(self))
        self.all_reduce(torch.zeros(1))  # vLLM's warm-up

    @classmethod
    def live(cls) -> int:
        return len(cls._live)

    def _run(self, work) -> bool:
        """Wait for `work` unless the communicator is aborted meanwhile; True when it completed."""
        self._works.append(work)
        while not work.is_completed():
            if self.disabled:
                return False
            time.sleep(1e-3)
        work.wait()  # raises gloo's error (a peer's connection closed)
        return True

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None):
        if self.disabled:
            return
        self._run(self._pg.broadcast(tensor, src))

    def all_reduce(self, in_tensor: torch.Tensor, out_tensor: torch.Tensor = None, op=dist.ReduceOp.SUM, stream=None):
        if self.disabled:
            return None
        out = in_tensor.clone() if out_tensor is None else out_tensor.copy_(in_tensor)
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        return out if self._run(self._pg.allreduce([out], opts)) else None

    def destroy(self):
        """The abort: later calls do nothing, an op in flight returns; the gloo group is kept by a daemon
        thread until its ops end (dropping it would wait for them: gloo_protocol.py TrackedGroup)."""
        if self.disabled:
            return
        self.available, self.disabled = False, True
        with self._lock:
            self._live.discard(id(self))
        pg, works, self._pg, self._works = self._pg, self._works, None, []
        threading.Thread(target=_keep_until_done, args=(pg, works), daemon=True).start()


def _keep_until_done(pg, works) -> None:
    while not all(w.is_completed() for w in works):
        time.sleep(0.5)
    del pg


class _NoStream:
    def synchronize(self) -> None:
        pass


def install(set_attribute=setattr) -> None:
    """Put the stand-in where vLLM builds its communicator, and make vLLM's CUDA-only calls on the NCCL
    path do nothing on CPU (device index, synchronize, the packed transfer's streams). In this process
    and in the processes forked from it; `set_attribute`: pytest's monkeypatch.setattr (undone after the test)."""
    from vllm.distributed.device_communicators import pynccl  # noqa: TID253 (vLLM side)
    from vllm.distributed.weight_transfer import packed_tensor  # noqa: TID253 (vLLM side)

    set_attribute(pynccl, "PyNcclCommunicator", GlooNcclCommunicator)
    set_attribute(torch.accelerator, "current_device_index", lambda: 0)
    set_attribute(torch.accelerator, "synchronize", lambda *a, **k: None)
    set_attribute(packed_tensor, "_get_streams", lambda device, n: tuple(_NoStream() for _ in range(n)))
    set_attribute(torch.cuda, "stream", lambda s: contextlib.nullcontext())
