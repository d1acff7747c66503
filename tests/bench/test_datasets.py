"""Workloads: seeded (the same arguments, the same requests), lengths as asked."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from pdserve.bench.client import arrival_gaps
from pdserve.bench.datasets import DatasetArgs, make


@pytest.mark.parametrize("name", ["random", "chat", "mixed", "prefix-sharing"])
def test_seeded_and_within_bounds(name):
    args = DatasetArgs(name=name, num_prompts=200, seed=3, input_len=100, output_len=20, max_len=2048)
    a, b = make(args), make(args)
    assert a == b and make(DatasetArgs(**{**args.__dict__, "seed": 4})) != a
    assert len(a) == 200
    for r in a:
        assert len(r.prompt) == r.prompt_len and r.prompt_len + r.output_len <= 2048
        assert all(7 <= t < 1000 for t in r.prompt)


def test_lengths_are_what_was_asked():
    exact = make(DatasetArgs(name="random", num_prompts=50, input_len=64, output_len=16))
    assert {r.prompt_len for r in exact} == {64} and {r.output_len for r in exact} == {16}
    ranged = make(DatasetArgs(name="random", num_prompts=300, input_len=100, range_ratio=0.5))
    assert min(r.prompt_len for r in ranged) >= 50 and max(r.prompt_len for r in ranged) <= 150
    chat = make(DatasetArgs(name="chat", num_prompts=2000, input_len=200, output_len=100))
    lens = [r.prompt_len for r in chat]
    assert 150 < statistics.median(lens) < 260 and max(lens) > 4 * statistics.median(lens)  # heavy tail
    mixed = make(DatasetArgs(name="mixed", num_prompts=400, input_len=128, long_len=1536, long_fraction=0.25))
    share_long = sum(r.prompt_len > 1000 for r in mixed) / len(mixed)
    assert 0.18 < share_long < 0.32


def test_prefix_sharing_shares_prefixes():
    reqs = make(DatasetArgs(name="prefix-sharing", num_prompts=40, num_prefixes=3, prefix_len=32, input_len=8))
    assert len({tuple(r.prompt[:32]) for r in reqs}) == 3
    assert len({tuple(r.prompt) for r in reqs}) == 40


def test_jsonl(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": [1, 2, 3], "output_len": 5}) for _ in range(4)))
    reqs = make(DatasetArgs(name="jsonl", path=str(path), num_prompts=3))
    assert len(reqs) == 3 and reqs[0].prompt_len == 3 and reqs[0].output_len == 5


def test_arrivals_follow_the_rate():
    gaps = arrival_gaps(4000, request_rate=4.0, burstiness=1.0, seed=1)
    assert gaps[0] == 0 and statistics.mean(gaps[1:]) == pytest.approx(0.25, rel=0.05)
    bursty = arrival_gaps(4000, 4.0, 0.25, seed=1)[1:]
    assert statistics.pstdev(bursty) > 1.5 * statistics.pstdev(gaps[1:])  # same mean, burstier
    assert arrival_gaps(5, math.inf, 1.0, 0) == [0.0] * 5
