"""Run one server: bind (port 0 allowed), report the bound port, serve until SIGINT/SIGTERM, or
until its engine dies.

Server process, main thread. Shutdown: uvicorn stops accepting and lets in-flight requests finish
for `shutdown_timeout_s`; then the engine thread aborts what is left and stops its TP ranks. An
engine that died (a TP rank gone, a step that raised) never comes back, so the server then exits
with status 1, within ENGINE_DEATH_EXIT_S, for whatever runs it (Ray, systemd, Kubernetes) to
restart it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import uvicorn

from pdserve.config import EngineConfig, ServerConfig
from pdserve.http.listen import bind, configure_logging, report_port
from pdserve.server.app import create_app
from pdserve.server.async_engine import AsyncEngine
from pdserve.worker.worker import GIL_SWITCH_INTERVAL_S

logger = logging.getLogger("pdserve.server")
ENGINE_DEATH_EXIT_S = 5.0  # after its engine died, the process is gone within this, shut down or not


def run_server(server: ServerConfig, engine: EngineConfig, log_level: str = "INFO") -> None:
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    configure_logging(log_level)
    sock = bind(server.host, server.port)
    report_port(sock, server.host, server.port_file, "server")
    app = create_app(server, engine)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=server.shutdown_timeout_s,
                            access_log=False, lifespan="on")
    http = uvicorn.Server(config)
    async_engine = app.state.engine
    threading.Thread(target=_stop_when_engine_dies, args=(async_engine, http),
                     name="pdserve-engine-watch", daemon=True).start()
    http.run(sockets=[sock])
    if async_engine.died:
        raise SystemExit(f"the engine died: {async_engine.error}")  # status 1


def _stop_when_engine_dies(engine: AsyncEngine, http: uvicorn.Server) -> None:
    """The requests in flight already have their error; stop serving, and if that hangs, exit."""
    engine.wait_exited()
    if not engine.died:
        return
    logger.error("the engine died (%s): the server exits", engine.error)
    http.should_exit = True
    time.sleep(ENGINE_DEATH_EXIT_S)
    logger.error("the server did not stop within %.0f s of its engine's death; exiting now",
                 ENGINE_DEATH_EXIT_S)
    os._exit(1)
