"""What else the machine is doing while a benchmark is about to run: its numbers mean little if
another process takes a share of the cores (left-over deployments did, unnoticed, in one sweep).

Benchmark client process. Linux: `/proc/stat`, sampled twice; elsewhere nothing is reported.
"""

from __future__ import annotations

import time
from pathlib import Path

BUSY_WARNING_CORES = 0.15  # above this, before a run, the results are not comparable


def cpu_times(stat_text: str) -> tuple[int, int, int] | None:
    """(busy, total) jiffies over all CPUs and the number of CPUs, from /proc/stat's text."""
    lines = stat_text.splitlines()
    head = next((ln.split() for ln in lines if ln.startswith("cpu ")), None)
    if head is None or len(head) < 5:
        return None
    ticks = [int(x) for x in head[1:9]]  # user nice system idle iowait irq softirq steal (guest is in user)
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    cpus = sum(1 for ln in lines if ln.startswith("cpu") and ln[3:4].isdigit())
    return sum(ticks) - idle, sum(ticks), max(cpus, 1)


def busy_cores(seconds: float = 1.0, stat_path: str = "/proc/stat") -> float | None:
    """How many cores' worth of work the machine did over the next `seconds` (None off Linux)."""
    path = Path(stat_path)
    if not path.exists():
        return None
    before = cpu_times(path.read_text())
    time.sleep(seconds)
    after = cpu_times(path.read_text())
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1]) * after[2]
