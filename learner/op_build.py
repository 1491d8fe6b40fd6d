"""DeepSpeed's shared-memory C++ op, which a CPU learner rank compiles the first time it starts.

DeepSpeed (0.19) JIT-builds `deepspeed_shm_comm` in `deepspeed.init_distributed` on a CPU rank without
a cached build: about a minute, several on a busy machine, and silent. torch's builder guards the build
directory with a `lock` file and every other builder polls until the file goes; a build killed part-way
leaves it behind, and every later learner then waits in its constructor, silently, for a lock nobody
holds. `check_shm_op_build` runs before that: it says what is compiling and why, and names a stale lock.

The build runs `ninja` from PATH. pip installs one beside this environment's Python (DeepSpeed needs it),
and a machine may have another (Debian's 1.11 here, pip's 1.13): ninja 1.12 changed the hash it keeps
of each build command, so a build by one and a load by the other rebuild the op every time they
alternate. That is a user who runs with the environment activated one day and not the next (the
SLURM script activates it, `make demo` does not). `environment_ninja` makes every build take the
environment's own.

A lock is stale when no process on this host works in the build directory (ninja and the compiler run
with it as their working directory) and the lock is older than LOCK_GRACE_S (the moment between
taking the lock and starting ninja).
"""
from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from torch.utils.cpp_extension import _get_build_directory

SHM_OP = "deepspeed_shm_comm"
LOCK_GRACE_S = 60.0


class StaleBuildLock(RuntimeError):
    """A build lock that no running build holds."""


def build_dir(name: str = SHM_OP) -> Path:
    """Where torch builds (and caches) the op: $TORCH_EXTENSIONS_DIR/<name>, else torch's per-user cache."""
    return Path(_get_build_directory(name, verbose=False))


def processes_working_in(directory: Path) -> list[int]:
    """Pids of this host's processes whose working directory is `directory` (those we may read)."""
    target, pids = os.path.realpath(directory), []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "cwd") == target:
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def check_shm_op_build(directory: Path, say=print, now=time.time, builders=processes_working_in) -> str:
    """Before a CPU rank's deepspeed.init_distributed: 'cached' | 'building' (ours) | 'waiting' (another
    process builds it), saying so; a stale lock raises StaleBuildLock naming it."""
    lock, built = directory / "lock", directory / f"{SHM_OP}.so"
    if lock.exists():
        try:
            age = now() - lock.stat().st_mtime
        except FileNotFoundError:  # the build that held it just finished
            return "cached"
        working = builders(directory)
        if not working and age > LOCK_GRACE_S:
            raise StaleBuildLock(
                f"the build lock {lock} is stale: it is {age:.0f}s old and no process on this host is building "
                f"DeepSpeed's {SHM_OP} op in {directory} (a build killed part-way leaves it behind), so this learner "
                f"would wait for it forever. Delete it (rm {lock}) and run again; the op is rebuilt (about a minute)")
        say(f"learner: another process (pid(s) {', '.join(map(str, working)) or 'starting'}) is compiling DeepSpeed's "
            f"{SHM_OP} op in {directory}; waiting for its build", flush=True)
        return "waiting"
    if built.exists():
        return "cached"
    say(f"learner: compiling DeepSpeed's shared-memory op {SHM_OP} (C++, once per machine and Python: about a minute, "
        f"several on a busy machine): DeepSpeed builds it when a CPU learner rank first starts; cached in {directory}",
        flush=True)
    return "building"


@contextmanager
def environment_ninja(bin_dir: Path | None = None):
    """While inside: this Python environment's own bin directory first on PATH when it holds a `ninja`,
    so that the op is built (and found up to date) by the same ninja whether or not the environment
    is activated. Nothing changes where the environment has no ninja of its own."""
    bin_dir = Path(sys.executable).parent if bin_dir is None else bin_dir
    before = os.environ.get("PATH")
    if (bin_dir / "ninja").is_file():
        os.environ["PATH"] = os.pathsep.join([str(bin_dir), *(before or "").split(os.pathsep)]).rstrip(os.pathsep)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before
