#!/usr/bin/env python3
"""A remote reward verifier for raygrpo, in the Python standard library only: the protocol by example.

Run it, then point a run at it:

    python examples/verifier_server.py --port 8000            # add --token SECRET to require one
    raygrpo train examples/cpu_demo.yaml 'reward.functions=[http://127.0.0.1:8000/verify]'
    # with --token: RAYGRPO_REWARD_TOKEN=SECRET raygrpo train ...
    # over TLS: --cert server.pem --key server.key, then https://... and, for a certificate your own
    # CA signed, reward.http_ca_file=ca.pem; add --client-ca ca.pem to require a client certificate that
    # CA signed (mutual TLS), which raygrpo presents from reward.http_client_cert (and reward.http_client_key)

The protocol (README, "Remote verifiers"). raygrpo POSTs `application/json` to the URL:

    {"prompts":     [...],   # the dataset's prompts: strings, or lists of {"role", "content"} messages
     "completions": [...],   # text for string prompts; [{"role": "assistant", "content": text}] for chat ones
     "answer":      [...],   # every dataset column, one value per sample (here the addition task's answer)
     "completion_ids": [[...], ...], "_num_tokens": [...], "_finish_reason": [...], ...}

at most `reward.http_max_batch` samples per request, and reads back

    {"rewards": [1.0, 0.0, null, ...]}     # one per sample; null: "cannot score this one"

A null leaves the sample out of its group's statistics and of the loss (it is not scored as 0).
Answer 200 with that body; 5xx and 429 are retried with backoff, 401/403/404 stop the run with
a message naming this URL, other 4xx count as errors for the request's samples.

This verifier scores arithmetic: 1.0 when the completion's last number equals the `answer`
column, 0.0 when it is another number, and null when the sample has no `answer` (it cannot tell).
"""
from __future__ import annotations

import argparse
import json
import re
import ssl
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def score(completion, answer) -> float | None:
    """One sample's reward, or None when it cannot be scored."""
    if answer is None:
        return None
    text = completion[-1]["content"] if isinstance(completion, list) else completion
    numbers = NUMBER.findall(text.replace(",", ""))
    return 1.0 if numbers and float(numbers[-1]) == float(answer) else 0.0


class Verifier(BaseHTTPRequestHandler):
    token: str | None = None  # set by main() from --token
    path_served = "/verify"

    def do_POST(self):  # noqa: N802 - the name http.server calls
        if self.path != self.path_served:
            return self._reply(404, {"error": f"POST to {self.path_served}"})
        if self.token and self.headers.get("Authorization") != f"Bearer {self.token}":
            return self._reply(401, {"error": "missing or wrong bearer token"})
        try:
            batch = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            completions = batch["completions"]
            answers = batch.get("answer", [None] * len(completions))
            rewards = [score(c, a) for c, a in zip(completions, answers)]
        except (ValueError, KeyError, TypeError) as e:
            return self._reply(400, {"error": f"bad request: {type(e).__name__}: {e}"})
        self._reply(200, {"rewards": rewards})

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, fmt, *args):  # one short line per request
        print(f"verifier: {self.address_string()} {fmt % args}", flush=True)


class VerifierServer(ThreadingHTTPServer):
    # raygrpo sends reward.http_concurrency requests per verifier at once, from every driver; socketserver's
    # backlog of 5 resets the connections past the 5th while the accept thread waits its turn (raygrpo retries them)
    request_queue_size = 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    parser.add_argument("--token", default=None, help="require 'Authorization: Bearer TOKEN'")
    parser.add_argument("--cert", default=None, help="serve https with this certificate (PEM; with --key)")
    parser.add_argument("--key", default=None, help="the certificate's private key (PEM)")
    parser.add_argument("--client-ca", default=None, help="require a client certificate this CA signed (PEM; "
                        "mutual TLS, with --cert and --key)")
    args = parser.parse_args()
    if (args.cert is None) != (args.key is None):
        parser.error("--cert and --key go together")
    if args.client_ca and not args.cert:
        parser.error("--client-ca needs --cert and --key (mutual TLS is TLS)")
    Verifier.token = args.token
    server = VerifierServer((args.host, args.port), Verifier)
    scheme = "http"
    if args.cert:
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(args.cert, args.key)
        if args.client_ca:
            tls.verify_mode = ssl.CERT_REQUIRED
            tls.load_verify_locations(args.client_ca)
        server.socket, scheme = tls.wrap_socket(server.socket, server_side=True), "https"
    print(f"verifier listening on {scheme}://{args.host}:{server.server_address[1]}{Verifier.path_served}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
