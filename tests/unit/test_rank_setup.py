"""A learner rank's torch.distributed world (learner/rank_setup.py), in this process: gloo on loopback."""
from __future__ import annotations

import datetime
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import threading
import types
from pathlib import Path

import pytest
import torch.distributed as dist

from actors.runtime.sockets import PortBoard
from cluster.config import RunConfig
from cluster.launch import placement
from cluster.launch.placement import learner_port_key
from learner.rank_setup import init_process_group, rendezvous_store


def test_a_lone_rank_starts_even_when_the_port_the_driver_picked_was_taken_since(monkeypatch):
    """No peer needs a lone rank's rendezvous port: it listens on any free one. Bound to the driver's pick, a
    port another process took in between failed the learner's start ("Address already in use") and cost every
    actor a restart (seen in an e2e run)."""
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)  # init_process_group sets it for the rank's process
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        init_process_group(False, "127.0.0.1", taken.getsockname()[1], rank=0, world_size=1)
        assert dist.is_initialized() and dist.get_world_size() == 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        taken.close()


ASKS_IF_MUON = """
import sys
import torch
{skip}
from deepspeed.runtime.zero import stage3, stage_1_and_2  # noqa: F401  (they ask "is it Muon?" as a rank builds)
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
adamw = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
print(MuonWithAuxAdam.__module__, isinstance(adamw, MuonWithAuxAdam), "torch._inductor.compile_fx" in sys.modules)
"""


def test_a_learner_rank_answers_deepspeeds_is_it_muon_without_compiling_muon():
    """DeepSpeed's Muon module compiles its kernels at import (its original_muon.py decorates them with
    torch.compile), which pulls in torch's inductor: a fifth of a CPU rank's construction. After skip_deepspeed_muon
    (what LearnerWorker does first) DeepSpeed's question is answered "no" for the learner's AdamW without it.
    Should DeepSpeed stop compiling at import, the first assertion says the skip can go."""
    muon = Path(importlib.util.find_spec("deepspeed").origin).parent / "runtime" / "zero" / "muon" / "original_muon.py"
    assert "@compiler.compile()" in muon.read_text()  # read, not imported: importing it is the cost
    skip = "from learner.rank_setup import skip_deepspeed_muon; skip_deepspeed_muon()"
    out = subprocess.run([sys.executable, "-c", ASKS_IF_MUON.format(skip=skip)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-3:] == ["learner.rank_setup", "False", "False"]


# As LearnerWorker starts a lone rank: its world from init_process_group (a lone rank listens on a port the OS picks,
# so no port is chosen here for another process to take first), then DeepSpeed over it.
INITS_DEEPSPEED = """
import os
import deepspeed
import deepspeed.comm.comm as ds_comm
from learner.rank_setup import init_process_group, skip_deepspeed_shm_op
os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1")
os.environ["MASTER_PORT"] = str(init_process_group(False, "127.0.0.1", 0, rank=0, world_size=1))
skip_deepspeed_shm_op()
deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, rank=0, world_size=1, verbose=False)
print(ds_comm.cdb.shm_comm_op, sorted(deepspeed.ops.__compatible_ops__.items()))
"""


def test_a_learner_rank_neither_builds_nor_loads_deepspeeds_shared_memory_op():
    """deepspeed.init_distributed on a CPU rank compiles DeepSpeed's shared-memory op when no build is cached (about
    a minute the first time on a machine) and loads it; only DeepSpeed's inference all-reduce uses it. After
    skip_deepspeed_shm_op (what LearnerWorker does before init_distributed) nothing is built, loaded or probed, in a
    torch extensions directory of its own. The source read first is the contract with the pinned DeepSpeed: the one
    place that asks whether the op may be built is build_shm_op, which TorchBackend calls; if that changes, so must
    the skip."""
    root = Path(importlib.util.find_spec("deepspeed").origin).parent
    readers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if "__compatible_ops__" in p.read_text())
    assert readers == ["comm/torch.py", "ops/__init__.py"], readers
    backend = (root / "comm" / "torch.py").read_text()
    assert "not deepspeed.ops.__compatible_ops__.get(builder.NAME, False)" in backend
    assert "self.shm_comm_op = build_shm_op()" in backend
    with tempfile.TemporaryDirectory() as extensions:
        out = subprocess.run([sys.executable, "-c", INITS_DEEPSPEED], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "TORCH_EXTENSIONS_DIR": extensions})
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.split("\n")[-2] == "None [('deepspeed_shm_comm', False)]", out.stdout[-2000:]
        assert list(Path(extensions).iterdir()) == []


def test_ranks_meet_on_the_port_rank_0_bound_itself_though_the_one_passed_was_taken():
    """Issue 59, item 10: the driver picked learner rank 0's port and rank 0 bound it seconds later, in another
    process; `make test` died there with "Address already in use" when something took it in between. Now a run
    passes a port key (cluster/launch/placement.py learner_port_key): rank 0 binds a port the OS picks in its own
    process and posts it, and rank 1 reads it. Here the port passed is held by another socket all along."""

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    board, key, timeout = PortBoard(kv={}), learner_port_key(), datetime.timedelta(seconds=20)
    stores = {}

    def rank(r):
        stores[r] = rendezvous_store("127.0.0.1", taken.getsockname()[1], r, 2, timeout, port_key=key, board=board)

    try:
        peer = threading.Thread(target=rank, args=(1,), daemon=True)
        peer.start()  # rank 1 first: it waits for rank 0's post
        rank(0)
        peer.join(20)
        assert board.read(key) == stores[0].port != taken.getsockname()[1]
        stores[1].set("hello", "from rank 1")
        assert stores[0].get("hello") == b"from rank 1"
    finally:
        taken.close()


def test_a_rank_that_never_sees_rank_0s_port_says_whom_it_waited_for():
    with pytest.raises(TimeoutError, match=r"learner rank 1 waited 0s for learner rank 0 to post the port"):
        PortBoard(kv={}).wait("learner-rendezvous-x", 0.2, "learner rank 1")


def test_a_run_passes_the_learner_ranks_no_port_only_a_key(monkeypatch):
    """The driver's half of item 10: start_learners hands every rank master_port 0 and one port key."""
    calls = []

    class FakeActorClass:
        def options(self, **_):
            return self

        def remote(self, *args, **kwargs):
            calls.append(kwargs)

    fake_ray = types.SimpleNamespace(remote=lambda *a, **k: FakeActorClass())
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    monkeypatch.setattr(placement, "lends_idle_cores", lambda cfg: False)
    cfg = RunConfig()
    cfg.learner.num_ranks = 2
    placement.start_learners(cfg, [None, None], "127.0.0.1", "learner-rendezvous-k", "host")
    assert [(c["master_port"], c["port_key"]) for c in calls] == [(0, "learner-rendezvous-k")] * 2
