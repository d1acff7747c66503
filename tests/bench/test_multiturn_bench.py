"""bench/multiturn.py --quick against the current code (no baseline), on the tiny model: every turn
is recorded, from turn 2 decode READs exactly the prompt blocks it did not hold (the previous prompt
and answer, but the answer's last token, never computed), and every greedy answer equals a
colocated instance's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "multiturn.py"
BLOCK = 16
ANSWER = 64


def test_multiturn_quick_reads_only_what_decode_lacks(tiny_model, tmp_path):
    out = tmp_path / "multiturn.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--model", tiny_model, "--no-baseline",
                        "--new-ref", "installed", "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "greedy answers equal colocated: all" in r.stdout
    res = json.loads(out.read_text())
    assert res["greedy_mismatches"] == []
    c = json.loads((Path(tiny_model) / "config.json").read_text())
    block_bytes = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * BLOCK * 4
    assert set(res["runs"]) == {"new"}
    for mode in ("a", "b"):  # (b): the producer's cache reset before every turn
        [records] = res["runs"]["new"][mode]
        assert [t["turn"] for t in records] == [1, 2, 3]
        assert [t["turn"] for t in res["medians"]["new"][mode]] == [1, 2, 3]
        held = 0
        for t in records:
            assert t["matches_colocated"]  # (the script fails unless each answer has 64 tokens)
            assert t["pd_decision"] == "remote"  # prefilled by the producer, READ by decode
            assert t["ttft_ms"] > 0 and t["e2e_ms"] >= t["ttft_ms"]
            lacked = -(-t["prompt_tokens"] // BLOCK) - held
            d = t["decode"]
            assert (d["blocks_read"], d["blocks_read_skipped"]) == (lacked, held), (mode, t["turn"])
            assert d["bytes_read"] == lacked * block_bytes
            assert d["prefix_cache_hits"] == held * BLOCK
            held = (t["prompt_tokens"] + ANSWER - 1) // BLOCK
        assert records[0]["decode"]["blocks_read"] == records[0]["prompt_tokens"] // BLOCK  # nothing held
        assert records[1]["prompt_tokens"] == records[0]["prompt_tokens"] + ANSWER + 64
    assert res["targets"]["decode_reads_exactly_what_it_lacked"] is True
