"""Block pool: reference counts, LRU reuse, prefix-cache hash chain, quarantine."""

from __future__ import annotations

from pdserve.engine.block_pool import BlockPool, NoFreeBlocksError
from pdserve.engine.request import Request
from pdserve.sampling_params import SamplingParams

import pytest


def _request(tokens, computed=None) -> Request:
    r = Request("r", tokens, SamplingParams(), (), 16)
    r.num_computed_tokens = len(tokens) if computed is None else computed
    return r


def test_allocate_release_counts():
    pool = BlockPool(4, 4)
    blocks = pool.allocate(3)
    assert pool.num_free_blocks == 1
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    pool.release(blocks)
    assert pool.num_free_blocks == 4


def test_prefix_hit_shares_blocks_and_keeps_last_token_to_compute():
    pool = BlockPool(8, 4)
    tokens = list(range(10, 22))  # three full blocks
    a = _request(tokens)
    a.block_ids = pool.allocate(3)
    pool.cache_full_blocks(a)
    b = _request(tokens + [99], computed=0)
    hits = pool.match_prefix(b)
    assert hits == a.block_ids
    same = _request(tokens, computed=0)
    assert pool.match_prefix(same) == a.block_ids[:2]  # a full hit leaves the last block to compute
    pool.take(hits)
    assert pool.ref_counts[hits[0]] == 2
    pool.release(a.block_ids)
    assert pool.num_free_blocks == 5  # still owned by b
    pool.release(hits)
    assert pool.num_free_blocks == 8
    # freed blocks keep their hash until reused
    assert pool.match_prefix(_request(tokens + [5], computed=0)) == a.block_ids


def test_hash_chain_depends_on_the_whole_prefix():
    pool = BlockPool(8, 2)
    a = _request([1, 2, 3, 4, 5])
    a.block_ids = pool.allocate(3)
    pool.cache_full_blocks(a)
    assert pool.match_prefix(_request([9, 9, 3, 4, 5], computed=0)) == []


def test_reuse_evicts_hash():
    pool = BlockPool(2, 2)
    a = _request([1, 2, 3])
    a.block_ids = pool.allocate(2)
    pool.cache_full_blocks(a)
    pool.release(a.block_ids)
    pool.allocate(2)  # reuses both blocks
    assert pool.match_prefix(_request([1, 2, 3], computed=0)) == []


def test_quarantine_keeps_blocks_out_of_reuse_until_due():
    pool = BlockPool(4, 4)
    blocks = pool.allocate(2)
    pool.quarantine_blocks(blocks, until=10.0)
    assert pool.num_free_blocks == 2 and pool.num_quarantined_blocks == 2
    assert pool.release_quarantine(now=9.0) == 0
    assert pool.release_quarantine(now=10.0) == 2
    assert pool.num_free_blocks == 4
