"""Listening sockets and logging of an HTTP process (server or proxy): bind (port 0 allowed), report
the bound port, one log format with the request id on every line."""

from __future__ import annotations

import json
import logging
import socket
import sys
from pathlib import Path

from pdserve.http.middleware import RequestIdFilter


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP,
    # and without it every streamed token waits out Nagle + delayed ACK (~40 ms measured).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def report_port(sock: socket.socket, host: str, port_file: str | None, what: str) -> int:
    port = sock.getsockname()[1]
    print(f"pdserve {what} listening on http://{host}:{port}", flush=True)
    if port_file:
        write_port_file(port_file, host, port)
    return port


def write_port_file(port_file: str, host: str, port: int) -> None:
    tmp = Path(port_file + ".tmp")
    tmp.write_text(json.dumps({"host": host, "port": port}))
    tmp.replace(port_file)


def configure_logging(level: str = "INFO") -> None:
    root = logging.getLogger()
    root.setLevel(level)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        "%(asctime)s %(process)d %(levelname)s [%(request_id)s] %(name)s: %(message)s"))
    handler.addFilter(RequestIdFilter())
    root.handlers = [handler]
