"""Hosts as a user has them, on one machine: Linux network namespaces joined by veth pairs to a
bridge, each with its own IPv4 and IPv6 address, made by the test (as root) and removed after.

The test process stays in the root namespace, on the bridge (x.x.x.254 and ::fe), so it reaches
every "host"; nothing is routed anywhere else.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid


def run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def can_make_namespaces() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (ip netns add)"
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`)"
    name = f"pdprobe{uuid.uuid4().hex[:6]}"
    try:
        run("ip", "netns", "add", name)
        run("ip", "netns", "del", name)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        return f"cannot make a network namespace: {getattr(e, 'stderr', b'').decode(errors='replace')}"
    return None


class Hosts:
    """`names` hosts on 10.<n>.0.<i> and fd<n>::<i>, bridged; `exec_prefix(host)` runs a command in one."""

    def __init__(self, names: list[str], subnet: int = 77):
        self.tag = uuid.uuid4().hex[:5]
        self.bridge = f"pdbr{self.tag}"
        self.subnet = subnet
        self.hosts = {name: (f"pd{self.tag}{i}", i + 1) for i, name in enumerate(names)}
        self.gateway4, self.gateway6 = f"10.{subnet}.0.254", f"fd{subnet}::fe"

    def ipv4(self, host: str) -> str:
        return f"10.{self.subnet}.0.{self.hosts[host][1]}"

    def ipv6(self, host: str) -> str:
        return f"fd{self.subnet}::{self.hosts[host][1]}"

    def exec_prefix(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[host][0]]

    def __enter__(self) -> "Hosts":
        try:
            run("ip", "link", "add", self.bridge, "type", "bridge")
            run("ip", "addr", "add", f"{self.gateway4}/24", "dev", self.bridge)
            run("ip", "-6", "addr", "add", f"{self.gateway6}/64", "dev", self.bridge, "nodad")
            run("ip", "link", "set", self.bridge, "up")
            for host, (ns, i) in self.hosts.items():
                outside, inside = f"pdv{self.tag}{i}", f"pdi{self.tag}{i}"
                run("ip", "netns", "add", ns)
                run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
                run("ip", "link", "set", inside, "netns", ns)
                run("ip", "link", "set", outside, "master", self.bridge)
                run("ip", "link", "set", outside, "up")
                run("ip", "-n", ns, "link", "set", "lo", "up")
                run("ip", "-n", ns, "addr", "add", f"{self.ipv4(host)}/24", "dev", inside)
                run("ip", "-n", ns, "-6", "addr", "add", f"{self.ipv6(host)}/64", "dev", inside, "nodad")
                run("ip", "-n", ns, "link", "set", inside, "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for ns, _ in self.hosts.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)
