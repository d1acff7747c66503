"""Descriptors of one READ: whole blocks coalesce into runs; head slices stay per block."""

from __future__ import annotations

import numpy as np

from pdserve.kv_transfer.descriptors import RegionTable, build_descriptors
from pdserve.kv_transfer.topology import HeadSlice, read_plan


def table(base: int, heads: int, blocks: int = 16, head_bytes: int = 64) -> RegionTable:
    block_bytes = heads * head_bytes
    return RegionTable((base, base + blocks * block_bytes), block_bytes, head_bytes, heads, blocks)


def test_equal_split_coalesces_runs_of_consecutive_blocks():
    local, remote = table(0x10000, 2), table(0x90000, 2)
    s = read_plan(1, 1, 2)[0][0]
    l, r = build_descriptors(local, remote, s, [0, 1, 2, 7], [4, 5, 6, 9])
    assert len(l) == 2 * 2  # two runs in each of two regions
    assert l[0].tolist() == [0x10000, 3 * 128, 0] and r[0].tolist() == [0x90000 + 4 * 128, 3 * 128, 0]
    assert l[1].tolist() == [0x10000 + 7 * 128, 128, 0]
    assert np.array_equal(l[:, 1], r[:, 1])


def test_head_slices_land_at_their_offsets():
    """A consumer with 1 head per rank reads producer rank 0's second head (P TP 1 holds 2)."""
    local, remote = table(0x10000, 1), table(0x90000, 2)
    s = HeadSlice(consumer_rank=1, producer_rank=0, first_head=1, num_heads=1, producer_offset=1,
                  consumer_offset=0)
    l, r = build_descriptors(local, remote, s, [3, 4], [5, 6])
    assert len(l) == 2 * 2  # never merged: the slices are strided
    assert r[0].tolist() == [0x90000 + 5 * 128 + 64, 64, 0] and l[0].tolist() == [0x10000 + 3 * 64, 64, 0]
