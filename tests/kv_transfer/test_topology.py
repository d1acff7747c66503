"""The global-head read plan (docs/design.md, "The TP plan"), over every (P TP, D TP, KV heads) up to 8."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pdserve.kv_transfer.descriptors import RegionTable, build_descriptors
from pdserve.kv_transfer.topology import expected_reads, producer_ranks_for, read_plan
from pdserve.model.parallel import kv_head_range


def _valid(tp: int, h: int) -> bool:
    return h % tp == 0 or tp % h == 0


CASES = [(p, d, h) for p, d, h in itertools.product(range(1, 9), range(1, 9), range(1, 9))
         if _valid(p, h) and _valid(d, h)]


@pytest.mark.parametrize("p_tp, d_tp, heads", CASES)
def test_every_consumer_head_read_exactly_once_inside_both_blocks(p_tp, d_tp, heads):
    plan = read_plan(p_tp, d_tp, heads)
    for c in range(d_tp):
        mine = kv_head_range(c, d_tp, heads)
        got = []
        for s in plan[c]:
            theirs = kv_head_range(s.producer_rank, p_tp, heads)
            for i in range(s.num_heads):
                h = s.first_head + i
                assert h in theirs and theirs.start + s.producer_offset + i == h
                assert mine.start + s.consumer_offset + i == h
            assert 0 <= s.producer_offset and s.producer_offset + s.num_heads <= len(theirs)
            assert 0 <= s.consumer_offset and s.consumer_offset + s.num_heads <= len(mine)
            got.extend(range(s.first_head, s.first_head + s.num_heads))
        assert sorted(got) == list(mine)  # each held head exactly once
    pairs = expected_reads(p_tp, d_tp, heads)
    assert pairs == {(c, r) for c in range(d_tp) for r in producer_ranks_for(c, p_tp, d_tp, heads)}


def test_design_rank_formulas():
    # D >= P: exactly one producer rank, d_rank // (d_tp // p_tp)
    for p_tp, d_tp in [(1, 2), (2, 4), (1, 8), (2, 8)]:
        for c in range(d_tp):
            assert producer_ranks_for(c, p_tp, d_tp, 8) == [c // (d_tp // p_tp)]
    # P > D: ranks d_rank * (p_tp // d_tp) ... + (p_tp // d_tp) - 1
    for p_tp, d_tp in [(2, 1), (4, 2), (8, 2)]:
        k = p_tp // d_tp
        for c in range(d_tp):
            assert producer_ranks_for(c, p_tp, d_tp, 8) == list(range(c * k, c * k + k))


def test_replicated_producer_reads_one_replica_per_head():
    # 1 KV head, P TP 4 (replicated 4x), D TP 1: one READ from one producer rank
    assert len(read_plan(4, 1, 1)[0]) == 1
    assert expected_reads(4, 1, 1) == {(0, 0)}


def _table(tp: int, heads: int, base: int) -> RegionTable:
    local = len(kv_head_range(0, tp, heads))
    head_bytes = 64
    block = local * head_bytes
    return RegionTable(tuple(base + i * 100 * block for i in range(4)), block, head_bytes, local, 100)


@pytest.mark.parametrize("p_tp, d_tp, heads", [(1, 1, 4), (2, 2, 4), (1, 2, 4), (2, 1, 4), (4, 1, 1)])
def test_descriptors_stay_inside_blocks_and_coalesce_when_whole(p_tp, d_tp, heads):
    remote_blocks, local_blocks = [5, 6, 7, 9], [10, 11, 12, 13]
    for c in range(d_tp):
        local = _table(d_tp, heads, base=1 << 20)
        for s in read_plan(p_tp, d_tp, heads)[c]:
            remote = _table(p_tp, heads, base=1 << 30)
            l, r = build_descriptors(local, remote, s, local_blocks, remote_blocks)
            assert l[:, 1].sum() == r[:, 1].sum() == 4 * len(remote_blocks) * s.num_heads * 64
            for descs, table in ((l, local), (r, remote)):
                for addr, length, _ in descs.tolist():
                    region = max(a for a in table.region_addresses if a <= addr)
                    assert addr + length <= region + table.num_blocks * table.block_bytes
            whole = s.num_heads == local.num_kv_heads == remote.num_kv_heads
            # runs: local 10-13 is one run, remote 5-7 then 9: two runs per region when whole
            assert len(l) == 4 * (2 if whole else 4)
            nl, _ = build_descriptors(local, remote, s, local_blocks, remote_blocks, coalesce=False)
            assert len(nl) == 16 and np.array_equal(np.sort(nl[:, 0])[:1], np.sort(l[:, 0])[:1])
