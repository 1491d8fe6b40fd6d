"""A local HTTP service for tests (reward verifiers, gateways): a ThreadingHTTPServer on 127.0.0.1 on a
free port, served from a daemon thread until close(); and a quiet handler base whose `send` survives a
client that stops reading (an over-size answer, a timed-out request); and examples/verifier_server.py
started as a user starts it (example_verifier)."""
from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

EXAMPLE_VERIFIER = Path(__file__).resolve().parents[1] / "examples" / "verifier_server.py"


class QuietHandler(BaseHTTPRequestHandler):
    def send(self, status: int, data: bytes | str) -> None:
        data = data.encode() if isinstance(data, str) else data
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client stopped reading (its cap, its timeout)
            pass

    def log_message(self, *args):
        pass


class BackloggedServer(ThreadingHTTPServer):
    """socketserver listens with a backlog of 5: a run's verifiers send 16+ requests at once, and while this
    process's accept thread waits for the GIL the kernel resets the connections past the 5th ("Connection reset by
    peer"). raygrpo retries those, so the server saw fewer requests than it was sent (CI, session 26's stop: /e500 got 7 of 8)."""
    request_queue_size = 128


class LocalServer:
    """Serves `handler` at `self.base` (http://127.0.0.1:PORT) until close()."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]):
        self.httpd = BackloggedServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@contextmanager
def example_verifier(*args: str) -> Iterator[str]:
    """examples/verifier_server.py with `args` (--token, --cert/--key, --client-ca), in its own process on a free
    port of 127.0.0.1, as a user starts it; yields its URL (the last word of the line it prints first) and stops
    it at the end of the block."""
    proc = subprocess.Popen([sys.executable, str(EXAMPLE_VERIFIER), "--port", "0", *args], stdout=subprocess.PIPE,
                            text=True)
    try:
        yield proc.stdout.readline().split()[-1]
    finally:
        proc.terminate()
        proc.wait(10)
