"""How busy the machine is, from /proc/stat's text (fixed inputs) and from this machine."""

from __future__ import annotations

import os
import threading
import time

import pytest

from pdserve.bench.machine import busy_cores, cpu_times

STAT = """cpu  100 0 50 800 50 0 0 0 0 0
cpu0 50 0 25 400 25 0 0 0 0 0
cpu1 50 0 25 400 25 0 0 0 0 0
intr 12345
"""


def test_busy_and_total_jiffies_and_cpu_count():
    assert cpu_times(STAT) == (150, 1000, 2)  # idle and iowait are not busy
    assert cpu_times("intr 1\n") is None


def test_missing_proc_stat_reports_nothing(tmp_path):
    assert busy_cores(0.01, str(tmp_path / "none")) is None


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux only: /proc/stat")
def test_a_spinning_thread_shows_as_busy():
    stop = time.monotonic() + 1.5

    def spin():
        while time.monotonic() < stop:
            pass
    t = threading.Thread(target=spin)
    t.start()
    try:
        assert busy_cores(0.5) > 0.5  # one thread spins the whole time: most of a core
    finally:
        t.join()
