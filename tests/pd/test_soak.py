"""The soak's short form (bench/soak.py runs it for minutes): mixed load through 2 producers and 1
decode with client cancels and producer kills and restarts; only requests a kill touched may fail,
no block leaks."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import soak  # noqa: E402


def test_short_soak(tiny_model, tmp_path):
    result = soak.main(["--model", tiny_model, "--duration", "25", "--clients", "4", "--kill-every", "8",
                        "--seed", "1", "--out", str(tmp_path / "soak.json"), "--plot", ""])
    assert result["requests"] > 20 and result["ok"] > 10, result
    assert result["kills"] >= 1, result
    assert result["failed_untouched"] == 0, result["untouched_failure_examples"]
    assert all(n == 0 for n in result["leaked_blocks"].values()), result["leaked_blocks"]
