"""Real server processes for tests: port 0, small fixed KV budget, one torch thread per rank."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

from pdserve.launcher import Instance

NUM_BLOCKS = 256


def start_server(model: str, log_dir: Path, *args: str, tp: int = 1, role: str = "server",
                 num_blocks: int = NUM_BLOCKS, env: dict | None = None, wait: bool = True) -> Instance:
    inst = Instance(role, ["serve", model, "--port", "0", "--tensor-parallel-size", str(tp),
                           "--num-threads", "1", "--num-blocks", str(num_blocks),
                           "--enable-debug-endpoints", *args])
    inst.spawn(log_dir, env)
    return inst.wait_healthy(120) if wait else inst


def get_json(url: str, timeout: float = 10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def post_json(url: str, body: dict, timeout: float = 60, headers: dict | None = None):
    """(status, parsed body) without raising on HTTP errors."""
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def stats(inst: Instance) -> dict:
    return get_json(inst.url + "/debug/stats")


def wait_idle(inst: Instance, timeout_s: float = 20.0) -> dict:
    """Wait until every block is free again and nothing runs; return the final stats."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = stats(inst)
        idle = s["num_free_blocks"] == s["num_blocks"] and not s["num_running"] \
            and not s["num_waiting"] and not s["num_waiting_for_remote_kv"]
        if idle or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


def _metrics(inst: Instance) -> str:
    with urllib.request.urlopen(inst.url + "/metrics", timeout=10) as r:
        return r.read().decode()


def metric(inst: Instance, name: str) -> float:
    """Sum of a Prometheus metric's samples (all label sets)."""
    total, found = 0.0, False
    for line in _metrics(inst).splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"metric {name} not exported"
    return total


def pd_decisions(proxy: Instance) -> dict[str, int]:
    """The proxy's `pd_decisions` counter by decision (local, remote), each it has counted."""
    prefix = 'pdserve_proxy:pd_decisions_total{decision="'
    out = {}
    for line in _metrics(proxy).splitlines():
        if line.startswith(prefix):
            decision, value = line[len(prefix):].split('"} ')
            if float(value):
                out[decision] = int(float(value))
    return out


INSTANCE_ARGS = ["--num-blocks", str(NUM_BLOCKS), "--enable-debug-endpoints",
                 "--kv-handshake-timeout-s", "5"]


def start_deployment(model: str, p_tp: int, d_tp: int, log_dir, extra: list[str] = (),
                     proxy_args: list[str] = ()):
    """Prefill + decode + proxy processes (real NIXL), the way `pdserve up` starts them."""
    from pdserve.launcher import Deployment
    dep = Deployment(model, [p_tp], [d_tp], instance_args=[*INSTANCE_ARGS, *extra],
                     log_dir=str(log_dir), proxy_args=list(proxy_args))
    return dep.start(timeout_s=120)
