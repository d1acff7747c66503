"""CPU used by an idle P/D deployment (1 prefill + 1 decode + proxy, no requests).

    .venv/bin/python bench/idle_cpu.py [--model DIR] [--seconds 10] [--prefill-tp 1] [--decode-tp 1]

Starts the deployment the way `pdserve up` does, sends a few requests (so NIXL peers are connected
and leases have come and gone), then sums user+system CPU time of every process of every instance
(TP ranks included) over an idle window. Target: under 5 % of one core in total.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from pdserve.cli import ensure_model  # noqa: E402
from pdserve.launcher import Deployment  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def processes() -> dict[int, tuple[int, int, float]]:
    """pid -> (parent, process group, CPU seconds so far: user + system)."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fields = (Path("/proc") / pid / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(pid)] = (int(fields[1]), int(fields[2]), (int(fields[11]) + int(fields[12])) / TICK)
    return out


def group_cpu_seconds(pgids: set[int], snapshot: dict | None = None) -> float:
    """CPU seconds of these process groups, from `snapshot` (a `processes()`) or read now."""
    return sum(cpu for _, pgid, cpu in (processes() if snapshot is None else snapshot).values() if pgid in pgids)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--prefill-tp", type=int, default=1)
    ap.add_argument("--decode-tp", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "idle_cpu.json"))
    args = ap.parse_args()
    model = ensure_model(args.model)
    dep = Deployment(model, [args.prefill_tp], [args.decode_tp], instance_args=["--kv-cache-gib", "0.25"])
    with dep:
        for i in range(3):
            body = json.dumps({"prompt": f"warm up {i} " * 20, "max_tokens": 8}).encode()
            req = urllib.request.Request(dep.proxy.url + "/v1/completions", body,
                                         {"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=120).read()
        time.sleep(2)  # let leases, notifications and heartbeats settle
        pgids = {i.proc.pid for i in [*dep.instances, dep.proxy]}
        before, t0 = group_cpu_seconds(pgids), time.monotonic()
        time.sleep(args.seconds)
        used, wall = group_cpu_seconds(pgids) - before, time.monotonic() - t0
    percent = 100 * used / wall
    result = {"prefill_tp": args.prefill_tp, "decode_tp": args.decode_tp, "seconds": round(wall, 1),
              "cpu_seconds": round(used, 3), "percent_of_one_core": round(percent, 2),
              "target_percent": 5.0}
    print(f"idle 1P1D + proxy (P TP {args.prefill_tp}, D TP {args.decode_tp}): {used:.2f} CPU-s "
          f"in {wall:.1f} s = {percent:.2f} % of one core (target < 5 %)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
