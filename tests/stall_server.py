"""A fake instance for proxy failure tests, run as its own process: healthy, and it takes every
completion request but never answers it (it stalls past any read timeout, or with `"die"` in the
prompt closes the connection without a word, as an instance killed mid-request would). It prints
its bound port, then serves until killed; it counts the requests it took at GET /taken."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TAKEN = []


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def _json(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            return self._json({"status": "ok", "load": {"num_waiting": 0}})
        if self.path == "/taken":
            return self._json({"taken": len(TAKEN)})
        if self.path == "/v1/models":
            return self._json({"data": [{"id": "tiny", "owned_by": "pdserve"}]})
        self.send_error(404)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        TAKEN.append(body)
        if "die" in json.dumps(body.get("prompt") or body.get("messages")):
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        time.sleep(30)


def main() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print(server.server_address[1], flush=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    sys.stdin.read()  # until the test (the parent) closes our stdin or dies


if __name__ == "__main__":
    main()
