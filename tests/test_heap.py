"""The collector's pause timer, on this process's own collections."""

from __future__ import annotations

import gc

from pdserve.heap import PAUSE_BUCKETS_S, PauseTimer


def test_pauses_are_timed_per_generation_into_cumulative_buckets():
    timer = PauseTimer().install()
    try:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    finally:
        timer.uninstall()
    gc.collect(2)  # not counted: uninstalled
    histograms = {gen: (buckets, seconds) for gen, buckets, seconds in timer.histograms()}
    buckets, seconds = histograms["2"]
    assert [b for b, _ in buckets] == [*map(str, PAUSE_BUCKETS_S), "+Inf"]
    assert buckets[-1][1] == 2 and seconds > 0 and timer.longest[2] > 0
    assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:]))  # cumulative
    assert histograms["0"][0][-1][1] >= 1
