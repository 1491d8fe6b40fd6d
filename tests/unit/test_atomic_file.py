"""actors/runtime/atomic_file.py: a file replaced whole, by one writer or several at once, and nothing left behind."""
from __future__ import annotations

import os
import threading

import pytest

from actors.runtime import atomic_file
from actors.runtime.atomic_file import replace_text


def test_a_reader_sees_the_old_file_or_the_new_one_never_a_part(tmp_path):
    path = tmp_path / "placement.json"
    old, new = "o" * 300_000, "n" * 300_000
    replace_text(path, old)
    seen: set[str] = set()
    stop = threading.Event()

    def read():
        while not stop.is_set():
            seen.add(path.read_text())

    reader = threading.Thread(target=read)
    reader.start()
    for i in range(40):
        replace_text(path, new if i % 2 else old)
    stop.set()
    reader.join()
    assert seen <= {old, new} and seen, {len(s) for s in seen}
    assert os.listdir(tmp_path) == ["placement.json"]


def test_writers_at_once_leave_one_whole_file_and_no_temporary(tmp_path):
    """Several writers of the same file (the actors of a run writing its logging config): the last rename wins,
    each temporary file is its writer's own, so none is renamed half-written by another."""
    path = tmp_path / "vllm_logging.json"
    texts = [str(i) * 50_000 for i in range(8)]
    threads = [threading.Thread(target=lambda t=t: [replace_text(path, t) for _ in range(20)]) for t in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert path.read_text() in texts
    assert os.listdir(tmp_path) == ["vllm_logging.json"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    replace_text(path, "row 1\n")

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic_file.os, "replace", refuse)
    with pytest.raises(OSError, match="No space left"):
        replace_text(path, "row 1\nrow 2\n", durable=True)
    assert path.read_text() == "row 1\n" and os.listdir(tmp_path) == ["metrics.jsonl"]


def test_durable_syncs_the_file_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    path = tmp_path / "raygrpo_manifest.json"
    calls: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append("dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file")
        real_fsync(fd)

    def replace(src, dst):
        calls.append("rename")
        real_replace(src, dst)

    monkeypatch.setattr(atomic_file.os, "fsync", fsync)
    monkeypatch.setattr(atomic_file.os, "replace", replace)
    replace_text(path, "{}", durable=True)
    assert calls == ["file", "rename", "dir"]
    calls.clear()
    replace_text(path, "{}")  # not durable: a rename alone
    assert calls == ["rename"]
