"""Shared storage checked before any model loads: every node that will run an actor of the run must
read the model directories and see the same run dir as the driver (checkpoints, exports and the
logs are written there by the ranks and read back by the driver).

The driver writes a nonce file into the run dir; a small task on each node reads it back and looks
at each model directory. A node that sees another run dir (a local disk mounted at the same path, a
stale NFS mount) reads no nonce or another one. Run on a joined cluster only: the embedded one is
this machine.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import socket
import time
from pathlib import Path

NONCE_FILE = ".raygrpo-shared-storage-check"


class SharedStorageError(RuntimeError):
    """A node of the run does not see the model or the run dir as the driver does."""


# A node's filesystem may cache "no such file" for a moment (NFS keeps negative lookups for up to
# acdirmin, 30 s by default): a node that does not read the nonce at once looks again, listing the
# directory (which revalidates it), for this long before it is said not to share the run dir.
NONCE_PATIENCE_S = 10.0


def look(model_paths: list[str], nonce_path: str, expected: str, patience_s: float = NONCE_PATIENCE_S) -> dict:
    """On one node: which model paths it cannot read, and the nonce it reads in the run dir."""
    models = {}
    for path in model_paths:
        p = Path(path)
        if not p.exists():
            models[path] = "does not exist there"
        elif not os.access(p, os.R_OK) or (p.is_dir() and not os.access(p, os.X_OK)):
            models[path] = "is not readable there"
        elif p.is_dir() and not (p / "config.json").exists():
            models[path] = "holds no config.json there (another directory at the same path?)"
    deadline = time.monotonic() + patience_s
    while True:
        try:
            nonce = Path(nonce_path).read_text()
        except OSError as e:
            nonce = None if isinstance(e, FileNotFoundError) else f"unreadable: {e.strerror or e}"
        if nonce == expected or time.monotonic() >= deadline:
            break
        time.sleep(1.0)
        with contextlib.suppress(OSError):
            os.listdir(Path(nonce_path).parent)
    return {"hostname": socket.gethostname(), "models": models, "nonce": nonce}


def check_shared_storage(ray, node_ids: list[str], model_paths: list[str], run_dir: str, timeout_s: float) -> None:
    """Raise SharedStorageError naming each node (host and address) and path it does not share with the driver."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = {n["NodeID"]: n for n in ray.nodes()}
    nonce_path = Path(run_dir).resolve() / NONCE_FILE
    nonce = secrets.token_hex(16)
    nonce_path.write_text(nonce)
    try:
        task = ray.remote(num_cpus=0, max_retries=0)(look)
        ids = sorted(set(node_ids))
        refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n, soft=False))
                .remote(model_paths, str(nonce_path), nonce) for n in ids]
        try:
            answers = ray.get(refs, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise SharedStorageError(
                f"the shared-storage check did not answer from every node within {timeout_s:.0f}s "
                f"(trainer.actor_timeout_s); nothing was loaded") from None
    finally:
        nonce_path.unlink(missing_ok=True)
    problems = []
    for node_id, a in zip(ids, answers):
        host = f"host {a['hostname']} ({nodes.get(node_id, {}).get('NodeManagerAddress', node_id[:12])})"
        problems += [f"{host}: model path {path} {why}" for path, why in a["models"].items()]
        if a["nonce"] != nonce:
            seen = "no such file there" if a["nonce"] is None else \
                (a["nonce"] if a["nonce"].startswith("unreadable") else "another run's nonce")
            problems.append(f"{host} does not see this run dir, trainer.run_dir={Path(run_dir).resolve()}: the driver "
                            f"wrote {nonce_path.name} there, {a['hostname']} reads {seen}")
    if problems:
        raise SharedStorageError(
            "shared storage: every node that runs an actor must read model.path and see the same trainer.run_dir "
            "as the driver (a filesystem mounted at the same path on every node: NFS, a cluster filesystem; "
            "README, Multi-node). Nothing was loaded.\n  " + "\n  ".join(problems))
