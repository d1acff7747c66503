"""bench/routing_load.py's figure and the README's table of it (bench/report_reuse.py), from a made-up
sweep: every point's row, its ratios to kv-aware, a plot written."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import report_reuse  # noqa: E402
from routing_load import plot  # noqa: E402


def _result(hit: float, p50: float, p90: float, **more) -> dict:
    return {"prefix_hit_rate": hit, "ttft_p50_ms": p50, "ttft_p90_ms": p90, **more}


SWEEP = {"rows": 800, "time_scale": 1.0, "num_blocks_per_instance": 384, "policies": ["kv-aware", "least-loaded"],
         "points": [{"speedup": s, "results": {"kv-aware": _result(0.62, 100 / s, 300 / s, itl_p99_ms=110.4,
                                                                   decisions={"local": 90.0, "remote": 710.0}),
                                               "least-loaded": _result(0.54, 150 / s, 600 / s, itl_p99_ms=120.0)},
                     "ttft_p50_over_kv_aware": {"least-loaded": 1.5}, "ttft_p90_over_kv_aware": {"least-loaded": 2.0}}
                    for s in (0.5, 0.25)]}


def test_the_table_has_a_row_per_load_with_the_ratios():
    lines = report_reuse.routing_load(SWEEP)
    rows = [line for line in lines if line.startswith("| 0.")]
    assert any(line.startswith("Least-loaded's TTFT p90 at least 2× kv-aware's (the target) at speedup 0.5, 0.25:") for line in lines)
    assert rows == ["| 0.5 | 62.0%, 200 / 600 | 54.0%, 300 / 1200 | 1.5× / 2.0× | 110 / 120 | 90 / 710 |",
                    "| 0.25 | 62.0%, 400 / 1200 | 54.0%, 600 / 2400 | 1.5× / 2.0× | 110 / 120 | 90 / 710 |"]
    header = [line for line in lines if line.startswith("| speedup")][0]
    assert header.count("|") == [line for line in lines if line.startswith("|---")][0].count("|")


def _bounded(balance: dict[float, float]) -> dict:
    """SWEEP with the LRU bound and each point's busiest ÷ mean (both pools alike)."""
    return {**SWEEP, "points": [{**point, "results": {**point["results"], "kv-aware": {
        **point["results"]["kv-aware"], "lru_bound_hit_rate": 0.68,
        "busiest_over_mean": {"prefill": balance[point["speedup"]], "decode": 1.0}}}}
        for point in SWEEP["points"]]}


def test_the_hit_rate_over_the_lru_bound_is_said_per_load():
    (said,) = [line for line in report_reuse.routing_load(_bounded({0.5: 1.1, 0.25: 1.1}))
               if line.startswith("kv-aware's hit rate")]
    assert "0.912 at speedup 0.5, 0.912 at speedup 0.25" in said and "1.1 / 1.0, 1.1 / 1.0" in said
    assert not [line for line in report_reuse.routing_load(SWEEP) if line.startswith("kv-aware's hit rate")]


def test_the_loads_where_one_replay_met_every_trace_target_are_named():
    """Hit rate ≥ 0.9 of the bound, busiest ≤ 1.15× the mean in both pools, least-loaded's TTFT p90
    ≥ 2× kv-aware's: all in the same run."""
    def said(sweep, rerun=None):
        (line,) = [x for x in report_reuse.routing_load(sweep, rerun) if x.startswith("All three")]
        return line
    assert said(_bounded({0.5: 1.1, 0.25: 1.1})).endswith(": speedup 0.5, speedup 0.25.")
    assert said(_bounded({0.5: 1.2, 0.25: 1.15})).endswith(": speedup 0.25.")  # 0.5 too unbalanced
    slower = _bounded({0.5: 1.1, 0.25: 1.1})
    slower["points"][0] = {**slower["points"][0], "ttft_p90_over_kv_aware": {"least-loaded": 1.9}}
    assert said(slower).endswith(": speedup 0.25.")
    low = _bounded({0.5: 1.1, 0.25: 1.1})
    for point in low["points"]:
        point["results"]["kv-aware"]["lru_bound_hit_rate"] = 0.7  # 0.62 / 0.7 = 0.886
    assert said(low).endswith(": none.")
    assert said(low, rerun=_bounded({0.5: 1.1, 0.25: 1.3})).endswith(": none (run again: speedup 0.5).")


def test_the_plot_is_written(tmp_path):
    plot(SWEEP, tmp_path / "load.png")
    assert (tmp_path / "load.png").stat().st_size > 1000


def test_a_rerun_is_quoted_beside_the_table():
    rerun = {"points": [{"speedup": 0.25, "ttft_p90_over_kv_aware": {"least-loaded": 1.7}}]}
    (said,) = [line for line in report_reuse.routing_load(SWEEP, rerun) if line.startswith("Least-loaded's")]
    assert said.endswith("least-loaded's TTFT p90 over kv-aware's was 1.7× at speedup 0.25.")
    (said,) = [line for line in report_reuse.routing_load(SWEEP) if line.startswith("Least-loaded's")]
    assert said.endswith("the ratio of two by up to ~30 %.")
