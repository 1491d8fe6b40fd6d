"""reward.code_sandbox=strict: the harness in fresh user, network, mount, pid, IPC and UTS namespaces
(util-linux `unshare`), chrooted into a root built for it, with no capability left.

    /usr, /lib*, /bin, /sbin    read-only binds of the host's (the system's programs and libraries)
    the interpreter's prefix    a read-only bind (pyenv's lives under the home dir: only it is bound)
    /dev                        null, zero, random, urandom only
    /proc                       this pid namespace's, read-only
    /tmp                        the program's one writable place: a tmpfs of reward.code_memory_mb
    /                           a tmpfs holding the mount points, read-only once they are made

Nothing else exists there: not the run dir, the home dir, the project, /etc or the host's /tmp. The
network namespace has only a loopback that is down (no route anywhere, 127.0.0.1 included). The
program's uid is the user namespace's root with every capability dropped (setpriv: empty bounding
set, no_new_privs), so it cannot mount, remount read-write, chroot out or change a limit back;
RLIMIT_NPROC counts the processes of this user namespace, so a fork bomb stops inside it. The harness
is the pid namespace's init: when it ends, or `unshare` is killed (--kill-child), every process in
the namespace dies, daemons that double-forked included.
"""
from __future__ import annotations

import os
import shlex
import shutil
import sys

from actors.runtime.sandbox.runner import Level, Limits

SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin")
DEVICES = ("null", "zero", "random", "urandom")
TOOLS = ("unshare", "setpriv", "chroot", "mount", "sh")
INSIDE_WORKDIR = "/tmp"


def _setup_script(root: str, prefix: str, memory_mb: int) -> str:
    """sh, run as the new namespaces' root: build the root over `root` (the host's empty temp dir)."""
    q = shlex.quote
    lines = ["set -e", f"mount -t tmpfs -o size=1m,mode=0755 raygrpo-root {q(root)}", f"cd {q(root)}"]
    for d in SYSTEM_DIRS:
        if os.path.islink(d):  # /bin -> usr/bin on merged-/usr systems
            lines.append(f"ln -s {q(os.readlink(d))} {q(d.lstrip('/'))}")
        elif os.path.isdir(d):
            lines += [f"mkdir -p {q(d.lstrip('/'))}", f"mount -o bind,ro {q(d)} {q(d.lstrip('/'))}"]
    if not any(prefix == d or prefix.startswith(d + "/") for d in SYSTEM_DIRS):
        lines += [f"mkdir -p {q(prefix.lstrip('/'))}", f"mount -o bind,ro {q(prefix)} {q(prefix.lstrip('/'))}"]
    lines += ["mkdir -p dev proc tmp", f"mount -t tmpfs -o size={memory_mb}m,mode=1777 raygrpo-tmp tmp"]
    for dev in DEVICES:
        lines += [f"touch dev/{dev}", f"mount -o bind /dev/{dev} dev/{dev}"]
    lines.append("mount -t proc -o ro,nosuid,nodev,noexec proc proc")
    lines.append(f"mount -o remount,ro {q(root)}")  # the root itself: nothing but /tmp is writable
    return "\n".join(lines)


class StrictLevel(Level):
    name = "strict"
    weaker = "process"
    pid_namespace = True

    def command(self, harness: list[str], workdir: str, limits: Limits) -> list[str]:
        prefix = os.path.realpath(sys.base_prefix)
        tool = {t: shlex.quote(shutil.which(t) or t) for t in TOOLS}  # the allow-listed PATH may lack sbin
        drop = f"{tool['setpriv']} --inh-caps=-all --ambient-caps=-all --bounding-set=-all --no-new-privs --"
        script = (_setup_script(workdir, prefix, limits.memory_mb)
                  + f"\nexec {tool['chroot']} {shlex.quote(workdir)} {drop} " + " ".join(shlex.quote(a) for a in harness))
        return [shutil.which("unshare") or "unshare", "--user", "--map-root-user", "--net", "--mount", "--pid", "--ipc", "--uts",
                "--fork", "--kill-child", "--", shutil.which("sh") or "sh", "-c", script]

    def workdir_inside(self, workdir: str) -> str:
        return INSIDE_WORKDIR

    def missing(self) -> str | None:
        absent = [t for t in TOOLS if shutil.which(t) is None]
        return f"{', '.join(absent)} not found on PATH (util-linux)" if absent else None
