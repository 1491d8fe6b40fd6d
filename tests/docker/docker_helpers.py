"""What the Docker tests share besides fixtures (conftest.py)."""
from __future__ import annotations

import socket
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "raygrpo:cpu"


def run(cmd: list[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    """A command's result with its output captured as text."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
