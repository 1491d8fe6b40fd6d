"""A learner rank's torch.distributed world (learner/rank_setup.py), in this process: gloo on loopback."""
from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

from learner.rank_setup import init_process_group


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
