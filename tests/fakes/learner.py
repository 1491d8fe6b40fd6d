"""FakeLearnerRank: one DeepSpeed rank as the driver sees it (learner/worker.py LearnerWorker's remote methods),
driven through the real cluster/driver/worker_groups.py LearnerGroup.

Its weight update does what the real one promises the driver (learner/weight_sending.py, fingerprint.py):
every engine of the transfer group (init_weight_sync's handles) holds `version` afterwards; an engine whose
fingerprint differs raises SyncMismatch; an engine dead or silent fails the learner's own call (the driver's
EngineWeights then checks the fleet). Only rank 0 sends, so only rank 0's answer says "verified"."""
from __future__ import annotations

from actors.transport.fingerprint import SyncMismatch
from tests.fakes.ray_like import FakeActor


class FakeLearnerRank(FakeActor):
    def __init__(self, rank: int, pid: int, loss: float = 0.5):
        super().__init__(pid)
        self.rank, self.loss = rank, loss
        self.engines: list = []  # the transfer group's engines (their handles)
        self.verifies = True  # False: a sender that does not check the engines' fingerprints
        self.batches: list = []  # the TrainBatch of each train_step
        self.saved: list[tuple[str, str]] = []
        self.lent: list[tuple[int, int]] = []

    def train_step(self, batch) -> dict:
        self.batches.append(batch)
        return {"loss": self.loss, "grad_norm": 1.0, "kl": 0.0}

    def lend_threads(self, call: int, n: int) -> None:
        self.lent.append((call, n))

    def init_weight_sync(self, rollout_handles: list, init_info: dict) -> None:
        self.engines = list(rollout_handles)
        self.engine_pids = [h.actor.pid for h in self.engines]  # a process that replaced one needs a new group

    def sync_weights(self, version: int) -> dict:
        if self.rank != 0:
            return {"bytes": 0, "verified": False, "verify_s": 0.0}
        for h, pid in zip(self.engines, self.engine_pids):
            e = h.actor
            if e.faults.dead or e.faults.hung or e.pid != pid:
                raise RuntimeError(f"the transfer to rollout worker {e.index} failed (fake: its process is gone)")
        for h in self.engines:
            if h.actor.wrong_weights:
                raise SyncMismatch(f"rollout worker {h.actor.index} holds other weights than version {version} (fake)")
            h.actor.weight_version = version
        return {"bytes": 1000 * len(self.engines), "verified": self.verifies, "verify_s": 0.01}

    def save_checkpoint(self, path: str, tag: str) -> None:
        self.saved.append((path, tag))

    def load_checkpoint(self, path: str, tag: str) -> None:
        pass

    def export_hf(self, out_dir: str) -> None:
        pass
