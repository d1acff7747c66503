"""The collector's pauses and frozen heap as Prometheus metrics, read at scrape time (server and proxy).

HTTP process. The timer (pdserve/heap.py) fills plain lists from inside the collector; this turns
them into `{prefix}:gc_pause_seconds{generation}` and `{prefix}:gc_frozen_objects` when scraped.
"""

from __future__ import annotations

import gc

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

from pdserve.heap import PauseTimer


class HeapMetrics:
    def __init__(self, prefix: str, timer: PauseTimer):
        self.prefix, self.timer = prefix, timer

    def collect(self):
        pauses = HistogramMetricFamily(
            f"{self.prefix}:gc_pause_seconds",
            "Python garbage collections: how long each held the process, by generation.",
            labels=["generation"])
        for generation, buckets, seconds in self.timer.histograms():
            pauses.add_metric([generation], buckets, seconds)
        yield pauses
        yield GaugeMetricFamily(f"{self.prefix}:gc_frozen_objects",
                                "Objects frozen at start-up: no collection scans them.",
                                value=gc.get_freeze_count())
