"""Run the proxy: bind (port 0 allowed), report the bound port, serve until SIGINT/SIGTERM."""

from __future__ import annotations

import uvicorn

from pdserve.config import ProxyConfig
from pdserve.proxy.app import create_app
from pdserve.http.listen import bind, configure_logging, report_port


def run_proxy(config: ProxyConfig, log_level: str = "INFO") -> None:
    configure_logging(log_level)
    sock = bind(config.host, config.port)
    report_port(sock, config.host, config.port_file, "proxy")
    app = create_app(config)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                  timeout_graceful_shutdown=10)).run(sockets=[sock])
