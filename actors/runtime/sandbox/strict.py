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
set, no_new_privs), so it cannot mount, remount read-write, chroot out or change a limit back. That
root is the driver's user on the host, or nobody (65534) when the driver runs as root: the host's
root is exempt from RLIMIT_NPROC, and owns the files a program must not touch. RLIMIT_NPROC then
holds a fork bomb inside. The harness is the pid namespace's init: when it ends, or `unshare` is
killed (--kill-child), every process in the namespace dies, daemons that double-forked included.

What the machine must allow (probed at start): user namespaces for the driver's user (or for nobody,
as root), and a fresh /proc, which the kernel refuses where the current one is partly masked (a
container runtime's default /proc); then the run refuses to start rather than run weaker.
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
SANDBOX_ID = 65534  # nobody / nogroup: the sandbox's user and group on the host when the driver runs as root


def _root_lines(root: str, prefix: str, memory_mb: int) -> list[str]:
    """sh that builds the sandbox's root over `root` (the host's empty temp dir), read-only but /tmp."""
    q = shlex.quote
    lines = [f"mount -t tmpfs -o size=1m,mode=0755 raygrpo-root {q(root)}", f"cd {q(root)}"]
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
    return lines + [f"mount -o remount,ro {q(root)}"]  # the root itself: nothing but /tmp is writable


class StrictLevel(Level):
    name = "strict"
    weaker = "process"
    pid_namespace = True

    def command(self, harness: list[str], workdir: str, limits: Limits, fds: list[int]) -> list[str]:
        """The driver's user: one user namespace (its root = that user) builds the root and runs the harness.
        Root: the root is built as root in a mount namespace of its own (so it may bind what only root can
        reach, e.g. pyenv's interpreter under /root), then the harness runs as nobody in fresh user, network,
        mount and pid namespaces: the host's root is exempt from RLIMIT_NPROC and owns every file a program
        must not touch, so the program must not be it."""
        q, tool = shlex.quote, {t: shutil.which(t) or t for t in TOOLS}  # the allow-listed PATH may lack sbin
        root_lines = _root_lines(workdir, os.path.realpath(sys.base_prefix), limits.memory_mb)
        namespaces = [tool["unshare"], "--user", "--map-root-user", "--net", "--mount", "--pid", "--ipc", "--uts",
                      "--fork", "--kill-child", "--", tool["sh"], "-c"]
        run = (f"mount -t proc -o ro,nosuid,nodev,noexec proc {q(workdir)}/proc\n"
               f"exec {q(tool['chroot'])} {q(workdir)} {q(tool['setpriv'])} --inh-caps=-all --ambient-caps=-all "
               "--bounding-set=-all --no-new-privs -- " + " ".join(q(a) for a in harness))
        if os.geteuid() != 0:
            return [*namespaces, "\n".join(["set -e", *root_lines, run])]
        nobody = [tool["setpriv"], f"--reuid={SANDBOX_ID}", f"--regid={SANDBOX_ID}", "--clear-groups", "--"]
        as_nobody = " ".join(q(a) for a in [*nobody, *namespaces, "set -e\n" + run])
        return [tool["unshare"], "--mount", "--propagation", "private", "--", tool["sh"], "-c",
                "\n".join(["set -e", *root_lines, f"exec {as_nobody}"])]

    def workdir_inside(self, workdir: str) -> str:
        return INSIDE_WORKDIR

    def missing(self) -> str | None:
        absent = [t for t in TOOLS if shutil.which(t) is None]
        return f"{', '.join(absent)} not found on PATH (util-linux)" if absent else None
