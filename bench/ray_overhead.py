"""What Ray costs: start-up of `pdserve up --ray` beside `pdserve up`, and the idle CPU of Ray's own
processes beside pdserve's.

    .venv/bin/python bench/ray_overhead.py [--model DIR] [--seconds 10]

As root (the Ray node is a network namespace: in the root namespace Ray picks its own address).
In one run: `pdserve up` (1P1D + proxy) from the command to a healthy proxy and its idle CPU; a
one-node Ray cluster (2 CPUs) from `ray start` to its address, its idle CPU alone; then `pdserve up
--ray` (1P1D) on it to a healthy proxy, and the idle CPU split between Ray's processes (GCS, raylet,
agents, the actors' workers), the driver, and pdserve's instances and proxy. Idle = after three
requests, nothing in flight.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests" / "multihost"))  # the namespace and Ray-node helpers

from idle_cpu import group_cpu_seconds, processes  # noqa: E402
from netns import Hosts, can_make_namespaces  # noqa: E402
from raycluster import RayCluster, ray_env  # noqa: E402

from pdserve.cli import ensure_model  # noqa: E402
from pdserve.launcher import Instance  # noqa: E402

def idle_cpu(groups: dict[str, set[int]], seconds: float) -> dict[str, float]:
    """Percent of one core each named set of process groups used over `seconds`."""
    before, t0 = processes(), time.monotonic()  # one snapshot of /proc at each end, for every group
    time.sleep(seconds)
    after, wall = processes(), time.monotonic() - t0
    return {name: round(100 * (group_cpu_seconds(pgids, after) - group_cpu_seconds(pgids, before)) / wall, 2)
            for name, pgids in groups.items()}


def children_groups(pid: int) -> set[int]:
    """The process groups of `pid`'s children (the instances and proxy a launcher started)."""
    return {pgid for _, (ppid, pgid, _) in processes().items() if ppid == pid}


def ask(url: str, n: int = 3) -> None:
    for i in range(n):
        body = json.dumps({"prompt": f"warm up {i} " * 20, "max_tokens": 8}).encode()
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=120).read()
    time.sleep(2)  # leases, notifications and heartbeats settle


def started(inst: Instance, logs: Path, env: dict, timeout_s: float = 600) -> float:
    t0 = time.perf_counter()
    inst.spawn(logs, env).wait_healthy(timeout_s)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "ray_overhead.json"))
    args = ap.parse_args()
    why = can_make_namespaces()
    if why:
        raise SystemExit(f"needs network namespaces: {why}")
    model = ensure_model(args.model)
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"pdserve-ray-bench-{os.getpid()}"
    logs.mkdir(parents=True, exist_ok=True)
    env = ray_env(PDSERVE_KV_SECRET=os.urandom(16).hex())
    result: dict = {"model": Path(model).name, "idle_window_s": args.seconds}

    local = Instance("up", ["up", model, "--port", "0"])
    try:
        result["pdserve_up_s"] = round(started(local, logs, env), 2)
        ask(local.url)
        result["idle_pdserve_up"] = idle_cpu({"all": {local.proc.pid} | children_groups(local.proc.pid)},
                                             args.seconds)["all"]
    finally:
        local.stop(60)

    with Hosts(["head"], subnet=79) as hosts:
        t0 = time.perf_counter()
        with RayCluster(hosts, [("head", {})], env=env) as ray:
            result["ray_start_s"] = round(time.perf_counter() - t0, 2)
            time.sleep(3)  # its agents finish starting
            result["idle_ray_alone"] = idle_cpu({"ray": ray.process_groups}, args.seconds)["ray"]
            head = hosts.ipv4("head")
            driver = Instance("ray-driver", ["up", model, "--ray", ray.address, "--port", "0", "--host", head],
                              host=head, prefix=hosts.exec_prefix("head"))
            try:
                result["pdserve_up_ray_s"] = round(started(driver, logs, env), 2)
                ask(driver.url)
                snap = processes()
                leaders = {pid: ppid for pid, (ppid, pgid, _) in snap.items() if pgid == pid}
                # Ray's workers (the actors) lead groups of their own, started by the raylet; each
                # instance is a group an actor started
                workers = {pid for pid, ppid in leaders.items()
                           if pid not in ray.process_groups and snap.get(ppid, (0, 0, 0))[1] in ray.process_groups}
                instances = {pid for pid, ppid in leaders.items() if ppid in workers}
                proxy = children_groups(driver.proc.pid) - {driver.proc.pid}
                result["idle_ray_deployment"] = idle_cpu(
                    {"ray": ray.process_groups | workers, "driver": {driver.proc.pid}, "instances": instances | proxy},
                    args.seconds)
            finally:
                driver.stop(60)
    result["ray_up_vs_local_up"] = round(result["pdserve_up_ray_s"] / result["pdserve_up_s"], 2)
    d = result["idle_ray_deployment"]
    print(f"start-up: pdserve up {result['pdserve_up_s']} s; ray start {result['ray_start_s']} s, then "
          f"pdserve up --ray {result['pdserve_up_ray_s']} s ({result['ray_up_vs_local_up']}x)")
    print(f"idle CPU (% of one core over {args.seconds:.0f} s): pdserve up {result['idle_pdserve_up']}; "
          f"Ray alone {result['idle_ray_alone']}; on Ray: Ray {d['ray']}, driver {d['driver']}, "
          f"instances + proxy {d['instances']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
