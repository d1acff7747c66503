"""`pdserve bench serve --dataset-name multi-turn` and `trace` against a real 1P1D deployment of the
tiny model: the turns carry their history, the trace's rows leave at their times, and the reuse the
instances counted is reported beside the LRU bound."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.bench.datasets import DatasetArgs, MultiTurnArgs, make
from pdserve.bench.instance_counters import instance_urls
from pdserve.launcher import Deployment
from servers import INSTANCE_ARGS

TINY_TRACE = Path(__file__).parent / "data" / "tiny_trace.jsonl"


@pytest.fixture(scope="module")
def deployment(tiny_model, tmp_path_factory):
    with Deployment(tiny_model, [1], [1], instance_args=INSTANCE_ARGS,
                    log_dir=str(tmp_path_factory.mktemp("reuse-e2e"))) as dep:
        yield dep


def bench(dep: Deployment, tmp_path: Path, *args: str) -> tuple[str, dict]:
    urls = [a for i in dep.prefill + dep.decode for a in ("--metrics-url", i.url)]
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "serve", "--base-url", dep.proxy.url,
                        *urls, *args, "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path),
                        "--result-filename", "out.json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r.stdout, json.loads((tmp_path / "out.json").read_text())


def test_multi_turn_reuses_each_history(deployment, tmp_path):
    assert instance_urls(deployment.proxy.url) == [deployment.prefill[0].url, deployment.decode[0].url]
    stdout, out = bench(deployment, tmp_path, "--dataset-name", "multi-turn", "--multi-turn-num-sessions", "2",
                        "--multi-turn-num-turns", "3", "--multi-turn-system-len", "64", "--multi-turn-user-len", "16",
                        "--multi-turn-answer-len", "8", "--multi-turn-think-time-s", "0.05",
                        "--multi-turn-think-time-dist", "fixed", "--lru-bound-blocks", "1000")
    asked = make(DatasetArgs(name="multi-turn", multi_turn=MultiTurnArgs(
        num_sessions=2, num_turns=3, system_len=64, user_len=16, answer_len=8)))
    assert out["completed"] == 6 and out["failed"] == 0
    assert out["input_lens"] == [r.prompt_len for r in asked] == [80, 104, 128] * 2  # the history grew
    assert out["output_lens"] == [8] * 6 and len(out["median_ttft_ms_by_turn"]) == 3
    # each turn's history was in a cache: of 2 x (80 + 104 + 128) prompt tokens, only each first
    # prompt and each later turn's new blocks (the answer's tail and the user's tokens) were computed
    assert out["prompt_tokens_computed"] == 2 * (80 + 24 + 32)
    assert out["prefill_hit_rate"] == pytest.approx(out["lru_bound_hit_rate"]) == pytest.approx(176 / 312)
    assert out["prefix_cache_hits"] > 0 and out["kv_bytes_transferred"] > 0
    assert set(out["instances"]) == {deployment.prefill[0].url, deployment.decode[0].url}
    assert "Prompt tokens not computed:" in stdout and "LRU bound (1000 blocks of 16):" in stdout


def test_trace_replays_at_its_timestamps(deployment, tmp_path):
    stdout, out = bench(deployment, tmp_path, "--dataset-name", "trace", "--dataset-path", str(TINY_TRACE),
                        "--trace-block-tokens", "16", "--lru-bound-blocks", "2")
    assert out["completed"] == 6 and out["failed"] == 0 and out["num_prompts"] == 6
    assert (out["trace_rows"], out["trace_rows_skipped"]) == (6, 8)
    assert "Trace rows (malformed, skipped):" in stdout and "6 (8)" in stdout
    assert out["input_lens"] == [38, 44, 22, 47, 32, 63] and out["duration"] >= 0.7
    assert out["unbounded_cache_hit_rate"] == pytest.approx(96 / 246)  # worked out in the trace's blocks
    assert out["lru_bound_hit_rate"] < out["unbounded_cache_hit_rate"]
    assert out["prefix_cache_hits"] > 0 and out["prompt_tokens_computed"] < sum(out["input_lens"])
