"""What `raygrpo submit` would upload, checked before Ray packs it: a symlink loop and an over-size
working dir are clear errors, found in bounded time.

Ray packs a working dir by walking it and following every symlink: a link to a directory above it
(`ln -s .. up`) is walked again and again until the OS's symlink limit, so the package holds the
tree dozens of times over; a working dir over Ray's upload limit is packed whole, minutes of zipping
on a large tree, before the upload fails with a raw "status code 413". That limit is the dashboard's
largest request, 100 MiB (`ray_constants.DASHBOARD_CLIENT_MAX_SIZE`, aiohttp's client_max_size; issue
59: 512 MiB, the gRPC message size, was checked here, and a 200 MB directory passed it). The files'
own size is counted: the zip is hardly larger (its headers), and smaller where they compress. This walk applies the
same exclusions Ray applies (submit's excludes, .gitignore, .rayignore), follows symlinks as Ray does
but only once per real directory, and stops at the first loop, at Ray's upload limit or at MAX_FILES.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

MAX_FILES = 200_000  # beyond this the walk stops: such a directory is no project directory
MAX_ENTRIES = 1_000_000  # entries looked at, excluded ones included: past this the check gives up (Ray packs it)


_QUIET = logging.getLogger(f"{__name__}.ignore_files")  # Ray's packer says the same when it packs
_QUIET.disabled = True


class UploadProblem(ValueError):
    """The working dir cannot be uploaded as it is."""


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def check_upload(wd: Path, excludes: list[str], max_bytes: int | None = None, max_files: int = MAX_FILES) -> int:
    """The bytes of the files Ray would pack from `wd`; UploadProblem for a symlink loop or a directory
    over max_bytes (None: Ray's upload limit, module docstring) / max_files (named, with its largest entries)."""
    from ray._private.ray_constants import DASHBOARD_CLIENT_MAX_SIZE
    from ray._private.runtime_env.packaging import get_excludes_from_ignore_files
    from ray._private.thirdparty.pathspec import PathSpec

    max_bytes = DASHBOARD_CLIENT_MAX_SIZE if max_bytes is None else max_bytes

    root = Path(wd).absolute()
    spec = PathSpec.from_lines("gitwildmatch", excludes)
    rules: list = []  # Ray's matchers of the .gitignore / .rayignore files of the directories walked
    total, files, seen, sizes = 0, 0, 0, {}  # sizes: bytes per top-level entry

    def excluded(p: Path, is_dir: bool) -> bool:
        rel = str(p.relative_to(root))
        return spec.match_file(rel + "/" if is_dir else rel) or any(rule(p) for rule in rules)

    def walk(d: Path, real_chain: tuple[str, ...]) -> None:
        nonlocal total, files, seen
        added = get_excludes_from_ignore_files(d, include_gitignore=True, logger=_QUIET)
        rules.extend(added)
        try:
            entries = sorted(d.iterdir())
        except OSError as e:
            raise UploadProblem(f"--working-dir {root}: cannot read {d} ({e.strerror})") from None
        for p in entries:
            seen += 1
            if seen > MAX_ENTRIES:
                raise _GaveUp
            is_link, is_dir = p.is_symlink(), p.is_dir()  # is_dir follows a link, as Ray does
            if excluded(p, is_dir):
                continue
            if is_dir:
                real = os.path.realpath(p)
                if is_link and (real in real_chain or any(c.startswith(real + os.sep) for c in real_chain)):
                    raise UploadProblem(
                        f"--working-dir {root}: the symlink {p} points to {real}, a directory it is inside of (a "
                        "loop): Ray's upload follows symlinks, so it would pack the tree again at every turn of the "
                        f"loop. Remove the link, or exclude it: add {p.relative_to(root)} to a .rayignore in {root}")
                walk(p, (*real_chain, real))
                continue
            try:
                size = p.stat().st_size
            except OSError:  # a dangling link: Ray skips it too
                continue
            total += size
            files += 1
            top = p.relative_to(root).parts[0]
            sizes[top] = sizes.get(top, 0) + size
            if total > max_bytes or files > max_files:
                raise UploadProblem(too_big(root, total, files, sizes, max_bytes, max_files))
        del rules[len(rules) - len(added):]

    try:
        walk(root, (os.path.realpath(root),))
    except _GaveUp:
        pass
    return total


class _GaveUp(Exception):
    """Too many (excluded) entries to look at: the check stops, and leaves the directory to Ray."""


def too_big(root: Path, total: int, files: int, sizes: dict, max_bytes: int, max_files: int) -> str:
    largest = ", ".join(f"{name} ({_mib(n)})" for name, n in sorted(sizes.items(), key=lambda x: -x[1])[:5])
    what = (f"more than {_mib(max_bytes)} (Ray's upload limit: its dashboard refuses a larger request, HTTP 413)"
            if total > max_bytes
            else f"more than {max_files} files")
    return (f"--working-dir {root} holds {what} to upload (stopped counting at {_mib(total)}, {files} files; largest: "
            f"{largest}). The working dir travels with every job: leave data and models out of it (a .rayignore or "
            ".gitignore there excludes them; point the config at them by absolute paths on storage the nodes see), "
            "or pass a smaller --working-dir")
