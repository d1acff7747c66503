"""The benchmark's statistics on fixed inputs: percentiles as numpy computes them, TTFT/ITL/TPOT
from chunk timings, goodput from SLOs, vLLM's field names."""

from __future__ import annotations

import pytest

from pdserve.bench.stats import RequestResult, chunk_times_to_result, parse_goodput, percentile, summarize


def test_percentiles_interpolate_like_numpy():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 50) == 2.5 and percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 90) == pytest.approx(3.7) and percentile([], 99) == 0.0
    assert percentile([5.0], 99) == 5.0


def test_timings_from_chunks():
    r = chunk_times_to_result(prompt_len=10, start=100.0, chunk_times=[100.2, 100.25, 100.45, 100.5],
                              end=100.6, output_len=4)
    assert r.ttft == pytest.approx(0.2) and r.e2el == pytest.approx(0.6)
    assert r.itls == pytest.approx([0.05, 0.2, 0.05])
    assert r.tpot == pytest.approx((0.6 - 0.2) / 3)
    assert chunk_times_to_result(1, 0.0, [0.5], 0.5, 1).tpot is None


def test_goodput_counts_requests_meeting_every_slo():
    fast = RequestResult(8, output_len=3, ttft=0.1, itls=[0.05, 0.05], e2el=0.3, success=True)
    slow_gap = RequestResult(8, output_len=3, ttft=0.1, itls=[0.05, 0.4], e2el=0.6, success=True)
    late = RequestResult(8, output_len=3, ttft=3.0, itls=[0.05, 0.05], e2el=3.2, success=True)
    failed = RequestResult(8, error="500")
    slos = parse_goodput(["ttft:2000", "itl:150"])
    assert slos == {"ttft": 2.0, "itl": 0.15}
    out = summarize([fast, slow_gap, late, failed], duration_s=2.0, slos=slos)
    assert out["request_goodput"] == 0.5 and out["goodput_fraction"] == 0.25
    assert out["completed"] == 3 and out["failed"] == 1 and out["total_output_tokens"] == 9
    assert out["request_throughput"] == 1.5 and out["output_throughput"] == 4.5
    assert out["median_ttft_ms"] == pytest.approx(100) and out["p99_itl_ms"] == pytest.approx(
        percentile([50, 50, 50, 400, 50, 50], 99))
    for key in ("mean_tpot_ms", "std_e2el_ms", "p90_ttft_ms", "input_lens", "output_lens", "ttfts", "itls", "errors"):
        assert key in out
    with pytest.raises(ValueError):
        parse_goodput(["latency:5"])


def test_pd_decisions_are_counted_when_a_proxy_labels_requests():
    done = [RequestResult(8, output_len=2, ttft=0.1, itls=[0.05], e2el=0.2, success=True, pd_decision=d)
            for d in ("local", "remote", "local")]
    assert summarize(done, 1.0)["pd_decisions"] == {"local": 2, "remote": 1}
    assert "pd_decisions" not in summarize([RequestResult(8, success=True)], 1.0)  # not a pdserve proxy
