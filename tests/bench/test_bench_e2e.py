"""`pdserve bench serve` and `pdserve bench sweep` end to end, for a few seconds each: the JSON has
vLLM's fields, the sweep starts and stops its deployments and writes its table and plots."""

from __future__ import annotations

import json
import subprocess
import sys

from pdserve.launcher import Deployment
from servers import INSTANCE_ARGS, pd_decisions

WORKLOAD = ["--dataset-name", "mixed", "--num-prompts", "12", "--random-input-len", "32",
            "--mixed-long-len", "400", "--random-output-len", "8", "--seed", "5",
            "--goodput", "ttft:2000", "itl:150", "--disable-tqdm"]


def pdserve(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_bench_serve_against_pdserve_up(tiny_model, tmp_path):
    with Deployment(tiny_model, [1], [1], instance_args=INSTANCE_ARGS, log_dir=str(tmp_path)) as dep:
        r = pdserve("bench", "serve", "--base-url", dep.proxy.url, "--request-rate", "8", *WORKLOAD,
                    "--save-result", "--result-dir", str(tmp_path), "--result-filename", "out.json")
        assert r.returncode == 0, r.stderr[-2000:]
        assert "Serving Benchmark Result" in r.stdout and "Request goodput" in r.stdout
        counted = pd_decisions(dep.proxy)  # the bench's labels are the proxy's X-PD-Decision headers
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["completed"] == 12 and out["failed"] == 0 and out["model_id"] == "tiny"
    # the proxy's label on each request; the one decode instance, idle while the producer works, may
    # take a new prompt itself (docs/design.md, "Overload, routing and shutdown")
    assert out["pd_decisions"] == counted and sum(counted.values()) == 12 and counted.get("remote", 0) >= 1
    from pdserve.bench.datasets import DatasetArgs, make  # the lengths the workload asked for
    asked = make(DatasetArgs(name="mixed", num_prompts=12, input_len=32, long_len=400, output_len=8, seed=5))
    assert out["output_lens"] == [r.output_len for r in asked] and out["input_lens"] == [r.prompt_len for r in asked]
    assert out["total_output_tokens"] == sum(r.output_len for r in asked)
    for key in ("duration", "request_throughput", "request_goodput", "output_throughput", "mean_ttft_ms",
                "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_itl_ms", "median_e2el_ms", "input_lens",
                "output_lens", "ttfts", "itls", "errors", "request_rate", "burstiness"):
        assert key in out, key
    assert [len(gaps) for gaps in out["itls"]] == [r.output_len - 1 for r in asked]  # a chunk per token
    # the client's longest collection pause (its start-up heap frozen): timed, and far below the run
    assert 0 < out["client_gc_pause_max_ms"] < 1000 * out["duration"]
    assert out["background_busy_cores"] >= 0  # sampled before the run (bench/machine.py)


def test_bench_sweep_starts_deployments_and_plots(tiny_model, tmp_path):
    r = pdserve("bench", "sweep", "--request-rates", "4,16",
                "--target", f"pd=up {tiny_model} --instance-args '--num-blocks 128'",
                "--target", f"colocated=serve {tiny_model} --num-blocks 128",
                *WORKLOAD, "--result-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "sweep.json").read_text())
    assert [(x["target"], x["request_rate"]) for x in summary["runs"]] == \
        [("pd", 4.0), ("pd", 16.0), ("colocated", 4.0), ("colocated", 16.0)]
    assert all(x["completed"] == 12 for x in summary["runs"])
    # each rate sends new prompts (the same ones again would be served from the prefix cache),
    # and every target gets the same ones at a rate
    assert [x["seed"] for x in summary["runs"]] == [5, 6, 5, 6]
    assert "| pd | 4.0 |" in (tmp_path / "sweep.md").read_text()
    for png in ("ttft.png", "itl.png", "goodput.png", "itl_cdf.png"):
        assert (tmp_path / png).stat().st_size > 5000, png
