"""A Ray cluster whose nodes are network namespaces (netns.Hosts): `ray start --block` per node, each
in its own process group, so stopping the group stops that node's raylet, workers and actors.

Ray always runs inside a namespace with `--node-ip-address`: in the root namespace it would pick
an address of its own choosing. Used by tests/multihost/test_ray.py and bench/ray_overhead.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from netns import Hosts

from pdserve.launcher import _die_with_parent, stop_group

RAY = str(Path(sys.executable).with_name("ray"))


def ray_env(**extra: str) -> dict:
    return {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **extra}


class RayCluster:
    """`nodes`: (host, custom resources) per node, the first one the head; `cpus` logical CPUs each."""

    def __init__(self, hosts: Hosts, nodes: list[tuple[str, dict]], cpus: int = 2, env: dict | None = None):
        self.hosts, self.nodes, self.cpus = hosts, nodes, cpus
        self.env = env or ray_env()
        self.temp = tempfile.mkdtemp(prefix="pdray", dir="/tmp")  # short: Ray's socket paths must fit
        self.procs: list[subprocess.Popen] = []
        self.address: str | None = None

    def _node(self, host: str, args: list[str]) -> subprocess.Popen:
        proc = subprocess.Popen(
            self.hosts.exec_prefix(host) + [RAY, "start", "--block", "--disable-usage-stats",
                                            "--node-ip-address", self.hosts.ipv4(host), *args],
            env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_die_with_parent)
        self.procs.append(proc)
        return proc

    def start(self, timeout_s: float = 120.0) -> "RayCluster":
        (head, resources), *workers = self.nodes
        try:
            proc = self._node(head, ["--head", "--port", "0", "--num-cpus", str(self.cpus), "--temp-dir", self.temp,
                                     "--include-dashboard=false", "--resources", json.dumps(resources)])
            address_file = Path(self.temp) / "ray_current_cluster"
            deadline = time.monotonic() + timeout_s
            while not address_file.exists():
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"the Ray head did not start; logs in {self.temp}")
                time.sleep(0.1)
            self.address = address_file.read_text().strip()
            for host, resources in workers:
                self._node(host, ["--address", self.address, "--num-cpus", str(self.cpus),
                                  "--resources", json.dumps(resources)])
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def process_groups(self) -> set[int]:
        return {p.pid for p in self.procs}

    def stop(self) -> None:
        for proc in reversed(self.procs):
            stop_group(proc, 20)
        shutil.rmtree(self.temp, ignore_errors=True)

    def __enter__(self) -> "RayCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
