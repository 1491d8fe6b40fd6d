"""A local HTTP service for tests (reward verifiers, gateways): a ThreadingHTTPServer on 127.0.0.1 on a
free port, served from a daemon thread until close(); and a quiet handler base whose `send` survives a
client that stops reading (an over-size answer, a timed-out request)."""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


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


class LocalServer:
    """Serves `handler` at `self.base` (http://127.0.0.1:PORT) until close()."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]):
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
