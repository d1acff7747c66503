"""Python's cyclic collector in a long-lived process: what start-up built is frozen out of its reach,
and every collection it still makes is timed.

Every serving process (instance, TP rank, proxy) and the benchmark client. Start-up leaves ~10^5
long-lived objects (torch, the web stack, the model's modules); a full (generation 2) collection
scans all of them, holding the GIL. Measured under load on one core: 156 ms in a decode instance,
which stopped every running stream at once, and 138 ms in the proxy (docs/design.md, "Serving
benchmark"). `gc.freeze()` moves them to a generation no collection scans, as vLLM does after its
engine starts; objects made later (requests, streams) are still collected as before.
"""

from __future__ import annotations

import bisect
import gc
import time
from typing import Iterator

PAUSE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


def freeze_startup_heap() -> int:
    """Collect what start-up left as garbage, then freeze every object still alive. Returns how many
    are frozen. Call once the process is ready to serve; calling again freezes what came since."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class PauseTimer:
    """Times every collection, per generation, while installed (`gc.callbacks`).

    The callback only adds to plain lists: it runs wherever the collector interrupts Python code,
    which may be inside a metrics library holding its own lock, so it takes none.
    """

    def __init__(self):
        self.counts = [[0] * (len(PAUSE_BUCKETS_S) + 1) for _ in range(3)]  # per generation, per bucket
        self.seconds = [0.0, 0.0, 0.0]
        self.longest = [0.0, 0.0, 0.0]
        self._started = 0.0

    def install(self) -> "PauseTimer":
        if self._on_collect not in gc.callbacks:
            gc.callbacks.append(self._on_collect)
        return self

    def uninstall(self) -> None:
        if self._on_collect in gc.callbacks:
            gc.callbacks.remove(self._on_collect)

    def _on_collect(self, phase: str, info: dict) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._started = now
            return
        gen, pause = info["generation"], now - self._started
        self.counts[gen][bisect.bisect_left(PAUSE_BUCKETS_S, pause)] += 1
        self.seconds[gen] += pause
        self.longest[gen] = max(self.longest[gen], pause)

    def histograms(self) -> Iterator[tuple[str, list[tuple[str, int]], float]]:
        """Per generation: (generation, cumulative [(upper bound, count)] ending at +Inf, seconds),
        as Prometheus histograms want them."""
        for gen in range(3):
            counts, total, buckets = list(self.counts[gen]), 0, []
            for bound, n in zip([*map(str, PAUSE_BUCKETS_S), "+Inf"], counts):
                total += n
                buckets.append((bound, total))
            yield str(gen), buckets, self.seconds[gen]
