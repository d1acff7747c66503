"""Run one server: bind (port 0 allowed), report the bound port, serve until SIGINT/SIGTERM.

Server process, main thread. Shutdown: uvicorn stops accepting and lets in-flight requests finish
for `shutdown_timeout_s`; then the engine thread aborts what is left and stops its TP ranks.
"""

from __future__ import annotations

import sys

import uvicorn

from pdserve.config import EngineConfig, ServerConfig
from pdserve.http.listen import bind, configure_logging, report_port
from pdserve.server.app import create_app
from pdserve.worker.worker import GIL_SWITCH_INTERVAL_S


def run_server(server: ServerConfig, engine: EngineConfig, log_level: str = "INFO") -> None:
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    configure_logging(log_level)
    sock = bind(server.host, server.port)
    report_port(sock, server.host, server.port_file, "server")
    app = create_app(server, engine)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=server.shutdown_timeout_s,
                            access_log=False, lifespan="on")
    uvicorn.Server(config).run(sockets=[sock])
