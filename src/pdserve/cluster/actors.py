"""The Ray actors of a pdserve deployment (plain classes; the driver wraps them with `ray.remote`).

Ray worker processes. An `InstanceActor` runs one `pdserve serve` on the node Ray placed it on
(its TP ranks stay on that node), bound to and advertising that node's address. The actor and its
instance live and die together: the instance dies with the actor (PR_SET_PDEATHSIG), and an
instance that exits takes the actor with it, so Ray restarts both (`max_restarts`). The `Registry`
is a named actor holding the wanted counts (`pdserve ray scale` sets them) and the driver's last
status (`pdserve ray status` reads it).
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

from pdserve.cluster.plan import check_counts
from pdserve.launcher import Instance, with_kv_events

NAMESPACE = "pdserve"
REGISTRY = "pdserve-registry"


class InstanceActor:
    def __init__(self, role: str, model: str, tp: int, threads: int, args: list[str], env: dict,
                 start_timeout_s: float = 600.0):
        import ray
        self.role = role
        self.host = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.stopping = False
        serve = ["serve", model, "--port", "0", "--host", self.host, "--side-channel-host", self.host,
                 "--tensor-parallel-size", str(tp), "--num-threads", str(threads),
                 *with_kv_events(args, self.host)]  # the proxy's KV index, from another node
        self.instance = Instance(role, serve, host=self.host)
        log_dir = Path(tempfile.mkdtemp(prefix=f"pdserve-ray-{role}-"))
        self.instance.spawn(log_dir, env).wait_healthy(start_timeout_s)
        threading.Thread(target=self._follow, name="follow-instance", daemon=True).start()

    def _follow(self) -> None:
        """An instance that exits (crash, OOM, kill) takes this actor down so Ray restarts both."""
        code = self.instance.proc.wait()
        if not self.stopping:
            print(f"pdserve {self.role} instance exited with {code}; the actor goes too", flush=True)
            os._exit(1)

    def info(self) -> dict:
        return {"url": self.instance.url, "host": self.host, "node_id": self.node_id, "actor_pid": os.getpid(),
                "serve_pid": self.instance.proc.pid, "log": str(self.instance.log_path),
                "alive": self.instance.proc.poll() is None, "state": "serving"}

    def stop(self, timeout_s: float = 60.0) -> None:
        """Graceful: the instance finishes its streams and leases (SIGTERM), within `timeout_s`."""
        self.stopping = True
        self.instance.stop(timeout_s)


class Registry:
    def __init__(self, prefill: int, decode: int):
        self.wanted = {"prefill": prefill, "decode": decode}
        self.status: dict = {}

    def scale(self, prefill: int | None = None, decode: int | None = None) -> dict:
        check_counts(prefill, decode)
        for role, n in (("prefill", prefill), ("decode", decode)):
            if n is not None:
                self.wanted[role] = n
        return dict(self.wanted)

    def get_wanted(self) -> dict:
        return dict(self.wanted)

    def report(self, status: dict) -> None:
        self.status = status

    def get_status(self) -> dict:
        return {**self.status, "wanted": dict(self.wanted)}
