"""NVIDIA's aiperf (PyPI `aiperf`, in a venv of its own under ~/.cache/pdserve-clients) benchmarks a
pdserve P/D deployment the way it benchmarks vLLM (issue 23): streamed chat requests through the
proxy, every one completed, with the request count, TTFT and token counts it reports."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from clients import client_venv
from servers import metric, start_deployment

AIPERF = "aiperf==0.13.0"  # no torch among its dependencies: its venv sees nothing of ours
NUM_REQUESTS = 8


@pytest.fixture(scope="module")
def pd(tiny_model, tmp_path_factory):
    dep = start_deployment(tiny_model, 1, 1, tmp_path_factory.mktemp("aiperf"),
                           proxy_args=["--routing", "least-loaded"])
    yield dep
    dep.stop()


@pytest.fixture(scope="module")
def aiperf_bin():
    return client_venv(AIPERF, "import aiperf") / "bin" / "aiperf"


def test_aiperf_profile_through_pd(pd, aiperf_bin, tiny_model, tmp_path):
    """8 streamed chat requests at concurrency 2: none fails, aiperf counts all 8 and measures a
    time to first token for each, and decode READ every prompt's KV from the producer."""
    transfers = metric(pd.decode[0], "pdserve:kv_transfers_total")
    # aiperf 0.13 in HF offline mode looks a local tokenizer path up as a hub repo id (and fails)
    env = {**{k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")},
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [str(aiperf_bin), "profile", "--model", "tiny", "--url", pd.proxy.url, "--endpoint-type", "chat",
         "--streaming", "--tokenizer", tiny_model, "--use-server-token-count",
         "--request-count", str(NUM_REQUESTS), "--concurrency", "2", "--workers-max", "2",
         "--record-processors", "1", "--prompt-input-tokens-mean", "24", "--prompt-input-tokens-stddev", "0",
         "--prompt-output-tokens-mean", "6", "--prompt-output-tokens-stddev", "0",
         "--extra-inputs", "ignore_eos:true", "--random-seed", "23", "--ui-type", "none",
         "--export-level", "summary", "--no-auto-plot", "--artifact-dir", str(tmp_path / "artifacts")],
        capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    exports = list((tmp_path / "artifacts").rglob("profile_export_aiperf.json"))
    assert exports, (run.stdout[-2000:], sorted(p.name for p in (tmp_path / "artifacts").rglob("*")))
    summary = json.loads(exports[0].read_text())
    assert summary["request_count"]["avg"] == NUM_REQUESTS, summary.get("request_count")
    assert summary.get("error_request_count", {}).get("avg", 0) == 0, summary.get("error_request_count")
    ttft = summary["time_to_first_token"]
    assert ttft["unit"] == "ms" and 0 < ttft["min"] <= ttft["avg"] <= ttft["max"], ttft
    assert summary["output_sequence_length"]["avg"] == 6, summary["output_sequence_length"]
    assert metric(pd.decode[0], "pdserve:kv_transfers_total") - transfers >= NUM_REQUESTS
