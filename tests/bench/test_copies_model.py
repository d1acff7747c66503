"""bench/copies_model.py's replay of a run's logged placements (`pdserve proxy --placement-log`):
each request cached where the proxy placed it, a spare copy evicted first, a kept one kept."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from copies_model import replay_placements  # noqa: E402


def _row(hash_ids):
    return {"hash_ids": hash_ids, "output_length": 16}


def _placed(prefill, decode, spare):
    return {"prefill": prefill, "decode": decode, "spare_copy": spare, "decision": "remote" if prefill else "local"}


def test_a_turn_placed_after_its_history_hits_it_wherever_it_is_kept():
    rows = [_row([1, 2]), _row([1, 2, 3])]  # 8 blocks, then the same 8 and 4 more
    for spare in ("decode", "prefill"):
        placements = [_placed("P1", "D1", spare), _placed("P2", "D2", spare)]
        assert replay_placements(rows, placements, [0.0, 1.0], capacity=64) == 8 / 20


def test_requests_are_matched_to_placements_in_the_order_they_started():
    rows = [_row([1, 2, 3]), _row([1, 2])]  # the longer turn started second
    placements = [_placed("P1", "D1", "decode"), _placed("P1", "D1", "decode")]
    assert replay_placements(rows, placements, [1.0, 0.0], capacity=64) == 8 / 20


def test_a_kept_copy_outlives_spare_ones_when_the_cache_is_full():
    # P1 keeps conversation 1 (8 blocks) and D1 holds it as the spare; conversation 2 (8 blocks) goes
    # the other way round on the same two. Full at 12 blocks, each evicts its spare first: P1 still
    # holds all of conversation 1 (D1 only its first 3 blocks), so its next turn finds 8 blocks
    rows = [_row([1, 2]), _row([5, 6]), _row([1, 2, 3])]
    placements = [_placed("P1", "D1", "decode"), _placed("P1", "D1", "prefill"), _placed("P2", "D2", "decode")]
    assert replay_placements(rows, placements, [0.0, 1.0, 2.0], capacity=12) == 8 / 28
