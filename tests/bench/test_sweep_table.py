"""The sweep's markdown table, from fixed runs: a column of local prefills appears when a
conditional proxy made any."""

from __future__ import annotations

from pdserve.bench.sweep import table

RUN = {"request_rate": 1.0, "completed": 10, "request_goodput": 0.8, "goodput_fraction": 0.8,
       "median_ttft_ms": 100, "p99_ttft_ms": 900, "median_itl_ms": 20, "p99_itl_ms": 40,
       "p99_max_itl_per_request_ms": 120, "median_tpot_ms": 21}


def test_local_prefills_get_a_column_only_when_there_are_any():
    plain = {"goodput_slos_ms": {"ttft": 2000}, "runs": [{**RUN, "target": "pd", "pd_decisions": {"remote": 10}}]}
    assert "prefilled on decode" not in table(plain)
    cond = {"goodput_slos_ms": {"ttft": 2000}, "runs": [
        {**RUN, "target": "pd", "pd_decisions": {"remote": 10}},
        {**RUN, "target": "pd-conditional", "pd_decisions": {"local": 7, "remote": 3}},
        {**RUN, "target": "colocated"}]}
    rows = table(cond).splitlines()
    assert rows[2].endswith("prefilled on decode |")
    assert rows[4].endswith("| 0 of 10 |") and rows[5].endswith("| 7 of 10 |") and rows[6].endswith("| – |")


def test_runs_started_on_a_busy_machine_are_named():
    runs = [{**RUN, "target": "pd", "background_busy_cores": 0.02},
            {**RUN, "target": "colocated", "background_busy_cores": 0.6},
            {**RUN, "target": "old", "background_busy_cores": None}]
    text = table({"goodput_slos_ms": {}, "runs": runs})
    assert text.splitlines()[-1] == "Not comparable: other work kept the machine busy before colocated " \
                                    "at 1.0 req/s (0.60 cores)."
    assert "Not comparable" not in table({"goodput_slos_ms": {}, "runs": runs[:1]})


def test_reuse_gets_a_column_beside_its_lru_bound_when_counted():
    runs = [{**RUN, "target": "kv-aware", "prefill_hit_rate": 0.61, "lru_bound_hit_rate": 0.66},
            {**RUN, "target": "least-loaded", "prefill_hit_rate": 0.2},
            {**RUN, "target": "vllm"}]
    rows = table({"goodput_slos_ms": {}, "runs": runs}).splitlines()
    assert rows[2].endswith("prompt tokens not computed (LRU bound) |") and rows[3].count("|") == rows[2].count("|")
    assert rows[4].endswith("| 61% (66%) |") and rows[5].endswith("| 20% |") and rows[6].endswith("| – |")
    assert "not computed" not in table({"goodput_slos_ms": {}, "runs": [{**RUN, "target": "pd"}]})
