"""Block pool: reference counts, LRU reuse, prefix-cache hash chain, quarantine."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.block_pool import BlockPool, NoFreeBlocksError
from pdserve.engine.request import Request
from pdserve.prefix_cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from pdserve.prefix_cache.hashing import event_hash, extra_keys, hash_blocks
from pdserve.sampling_params import SamplingParams


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


# --- content hashes, salts and KV events (docs/design.md, "Prefix cache: hashes and KV events") ---

def _salted(tokens, salt=None, computed=None) -> Request:
    r = Request("r", tokens, SamplingParams(), (), 16, cache_salt=salt)
    r.num_computed_tokens = len(tokens) if computed is None else computed
    return r


def _stored(pool: BlockPool, r: Request) -> Request:
    r.block_ids = pool.allocate(pool.blocks_needed(r.num_tokens))
    pool.cache_full_blocks(r)
    return r


def test_prefix_cache_keys_are_content_hashes_anyone_can_compute():
    pool = BlockPool(8, 4, model_key="model-x")
    tokens = list(range(10, 23))
    r = _stored(pool, _salted(tokens))
    assert r.block_hashes == hash_blocks(tokens, 4, extra_keys("model-x"))
    assert set(pool.cached) == set(r.block_hashes)


def test_a_salted_request_never_hits_another_salts_blocks():
    pool = BlockPool(16, 4, model_key="m")
    tokens = list(range(40, 53))
    a = _stored(pool, _salted(tokens, "tenant-a"))
    assert pool.match_prefix(_salted(tokens + [1], "tenant-b", computed=0)) == []
    assert pool.match_prefix(_salted(tokens + [1], None, computed=0)) == []
    assert pool.match_prefix(_salted(tokens + [1], "tenant-a", computed=0)) == a.block_ids[:3]


class _Events:
    """Applies a pool's events the way a subscriber would."""

    def __init__(self):
        self.hashes: set[int] = set()
        self.log: list = []

    def __call__(self, events):
        for e in events:
            self.log.append(e)
            if isinstance(e, BlockStored):
                assert not self.hashes & set(e.block_hashes), "stored twice"
                assert len(e.token_ids) == e.block_size * len(e.block_hashes) == 4 * len(e.block_hashes)
                self.hashes.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert set(e.block_hashes) <= self.hashes, "removed what was never stored"
                self.hashes.difference_update(e.block_hashes)
            else:
                self.hashes.clear()


def _held(pool: BlockPool) -> set[int]:
    return {event_hash(h) for h in pool.cached}


def test_events_say_exactly_what_the_pool_caches_under_evictions():
    rng = random.Random(3)
    events = _Events()
    pool = BlockPool(12, 4, model_key="m", on_events=events)
    prefixes = [[rng.randrange(100) for _ in range(8)] for _ in range(3)]
    live: list[Request] = []
    for step in range(300):
        if live and (rng.random() < 0.5 or pool.num_free_blocks < 4):
            r = live.pop(rng.randrange(len(live)))
            pool.release(r.block_ids)
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(100) for _ in range(rng.randrange(1, 8))]
            r = _salted(tokens, rng.choice([None, "s"]), computed=0)
            hits = pool.match_prefix(r)
            pool.take(hits)
            r.block_ids = hits + pool.allocate(pool.blocks_needed(len(tokens)) - len(hits))
            r.num_computed_tokens = len(tokens)
            pool.cache_full_blocks(r)
            live.append(r)
        assert events.hashes == _held(pool), step
    assert sum(isinstance(e, BlockRemoved) for e in events.log) > 10  # blocks were evicted
    pool.reset_prefix_cache()  # with blocks still in use: nothing stays cached
    assert isinstance(events.log[-1], AllBlocksCleared) and events.hashes == _held(pool) == set()
    assert all(pool.match_prefix(_salted(p + [1], computed=0)) == [] for p in prefixes)


def test_one_block_per_hash_and_removed_only_when_it_goes():
    events = _Events()
    pool = BlockPool(8, 4, model_key="m", on_events=events)
    tokens = list(range(9))
    first, second = _salted(tokens, computed=0), _salted(tokens, computed=0)
    for r in (first, second):  # both computed the prompt before either cached it: two copies
        r.block_ids = pool.allocate(3)
    for r in (first, second):
        r.num_computed_tokens = 9
        pool.cache_full_blocks(r)
    assert len(pool.cached) == 2 and len([e for e in events.log if isinstance(e, BlockStored)]) == 1
    stored = events.log[0]
    assert stored.parent_block_hash is None and stored.extra_keys == [["m"], ["m"]]
    assert stored.token_ids == tokens[:8] and stored.medium == "cpu"
    pool.release(second.block_ids)
    pool.allocate(3)  # reuses the second's uncached copies: nothing the pool cached went
    assert not any(isinstance(e, BlockRemoved) for e in events.log)
    pool.release(first.block_ids)
    pool.allocate(5)
    assert events.hashes == _held(pool) == set()
    removed = [h for e in events.log if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(stored.block_hashes)


def _cached(pool: BlockPool, tokens: list[int]) -> Request:
    r = _request(tokens)
    r.block_ids = pool.allocate(len(tokens) // pool.block_size)
    pool.cache_full_blocks(r)
    return r


def test_spare_copies_are_reused_before_the_cache_proper():
    """A prompt another instance keeps (the proxy's `spare_copy`) is evicted before older prompts
    this instance keeps: what is freed as spare goes first, in LRU order among spares."""
    pool = BlockPool(6, 2)
    kept = _cached(pool, [1, 2, 3, 4])
    pool.release(kept.block_ids, spare=False)
    spare = _cached(pool, [5, 6, 7, 8])
    pool.release(spare.block_ids, spare=True)
    assert pool.num_free_blocks == 6 and pool.num_spare_blocks == 4  # with two that cache nothing
    assert len(set(pool.allocate(2)) & set(spare.block_ids)) == 0  # those two first
    assert set(pool.allocate(2)) == set(spare.block_ids)
    assert pool.match_prefix(_request([5, 6, 7, 8, 0], computed=0)) == []  # the spare copy went
    assert pool.match_prefix(_request([1, 2, 3, 4, 0], computed=0)) == kept.block_ids  # older, kept


def test_a_block_any_request_kept_stays_kept_and_a_hit_leaves_the_spare_list():
    pool = BlockPool(4, 2)
    a = _cached(pool, [1, 2, 3, 4])
    pool.take(a.block_ids)  # a second request shares the prompt
    pool.release(a.block_ids, spare=False)
    pool.release(a.block_ids, spare=True)  # the last owner's spare does not undo the first one's keep
    assert set(pool.free) == set(a.block_ids) and pool.num_free_blocks == 4
    b = _cached(pool, [9, 9, 9, 9])
    pool.release(b.block_ids, spare=True)
    assert set(pool.spare) == set(b.block_ids)
    pool.take(b.block_ids[:1])  # a hit takes a spare block out of the free lists
    assert pool.num_spare_blocks == 1 and pool.num_free_blocks == 3
    pool.release(b.block_ids[:1])  # no word: it stays a spare copy
    assert pool.num_spare_blocks == 2


def test_a_leased_block_marked_spare_is_freed_as_spare():
    """A producer's hand-off marks its lease's blocks; the lease frees them later with no word."""
    pool = BlockPool(4, 2)
    a = _cached(pool, [1, 2, 3, 4])
    pool.mark(a.block_ids, spare=True)
    pool.release(a.block_ids)
    assert set(pool.spare) == set(range(4))
    pool.allocate(4)
    assert pool.copy == bytearray(4)  # reused blocks forget what their last copy was


def test_a_demoted_block_is_a_spare_copy_until_a_request_here_keeps_it_again():
    """Another instance claimed the blocks to keep them (a history moved): this copy goes first,
    whoever kept it before, until a request that uses it here releases it kept."""
    pool = BlockPool(6, 2)
    moved = _cached(pool, [1, 2, 3, 4])
    pool.release(moved.block_ids, spare=False)
    other = _cached(pool, [5, 6, 7, 8])
    pool.release(other.block_ids, spare=False)
    assert pool.pin(pool.block_hashes(_request([1, 2, 3, 4, 0]), 2), spare=True) == moved.block_ids
    pool.release(moved.block_ids)  # the lease ends with no word
    assert set(pool.spare) >= set(moved.block_ids) and set(pool.free) == set(other.block_ids)
    assert set(pool.allocate(4)) >= set(moved.block_ids)  # reused before the older kept prompt
    assert pool.match_prefix(_request([5, 6, 7, 8, 0], computed=0)) == other.block_ids
    again = _cached(pool, [1, 2, 3, 4])
    pool.release(again.block_ids, spare=False)
    pinned = pool.pin(pool.block_hashes(_request([1, 2, 3, 4, 0]), 2), spare=True)
    pool.take(pinned)  # a request here hits them while the claim holds them
    pool.release(pinned)  # the lease ends
    pool.release(pinned, spare=False)  # the request here wants them kept: kept again
    assert set(pool.free) >= set(again.block_ids)
