"""bench/routing_multiturn.py's summary over repeated runs and the README's table of it
(bench/report_reuse.py), from made-up runs."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import report_reuse  # noqa: E402
from routing_multiturn import summarize  # noqa: E402


def _run(rate: float, policy: str, p50: float, history: float = 0.98) -> dict:
    return {"rate": rate, "policy": policy, "ttft_p50_ms": p50, "ttft_p90_ms": 4 * p50, "itl_p99_ms": 100.0,
            "history_from_cache": history, "decisions": {"local": 30.0, "remote": 42.0}}


RUNS = [_run(0.5, "kv-aware", 300, 0.97), _run(0.5, "least-loaded", 1000), _run(0.5, "kv-aware", 250),
        _run(0.5, "least-loaded", 550), _run(0.5, "kv-aware", 290), _run(0.5, "least-loaded", 560),
        _run(1.0, "kv-aware", 300)]


def test_the_ratio_is_of_the_median_runs_and_the_history_of_the_worst():
    """One least-loaded run's p50 of 1,000 ms among 550 and 560 does not double the ratio."""
    assert summarize(RUNS) == {"0.5": {"ttft_p50_least_loaded_over_kv_aware": round(560 / 290, 2),
                                       "kv_aware_history_from_cache": 0.97}}  # 1.0: no least-loaded run


def test_the_table_has_a_row_per_run_with_its_itl_and_says_how_runs_are_compared():
    result = {"sessions": 12, "turns": 6, "system": 512, "user": 64, "answer": 64, "repeats": 3,
              "results": RUNS[:6], "summary": summarize(RUNS)}
    lines = report_reuse.routing_multiturn(result)
    rows = [line for line in lines if line.startswith("| 0.5")]
    assert len(rows) == 6 and rows[0] == "| 0.5 | kv-aware | 300 / 1200 | 100 | 97.0% | 30 / 42 |"
    header = [line for line in lines if line.startswith("| sessions/s")][0]
    assert header.count("|") == rows[0].count("|")
    assert lines[-1].endswith("(median TTFT p50 of 3 runs each). 0.5 sessions/s: 1.93×.")
