"""Delta reads on the loopback transport: a consumer that already caches the prompt's leading blocks
READs only the rest, a full hit READs nothing and frees the producer at once, and a READ that fails
never quarantines or frees a shared cached block (docs/design.md, "Reuse")."""

from __future__ import annotations

import numpy as np
import pytest

from harness import BLOCK_SIZE, expected_kv
from pdserve.kv_transfer.transfer_state import TransferState


def pair(world, p_tp=1, d_tp=1, **kw):
    return world.instance("P", p_tp, **kw), world.instance("D", d_tp, **kw)


def cached_blocks(d, num_blocks: int, seed: int) -> list[int]:
    """Blocks decode's prefix cache would hand the request: the prompt's first full blocks."""
    blocks = d.pool.allocate(num_blocks)
    d.fill(blocks, seed)
    return blocks


def counters(inst) -> dict:
    return inst.connector.consumer.counter_values()


@pytest.mark.parametrize("p_tp, d_tp", [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_only_the_blocks_decode_lacks_are_read(world, p_tp, d_tp):
    p, d = pair(world, p_tp, d_tp)
    params = p.prefill("p1", 22, seed=3)  # 5 full blocks and a partial one
    d.receive("r1", params)
    held = cached_blocks(d, 3, seed=3)
    d.admit("r1", 22, cached=held)
    world.run()
    assert d.outcome("r1").state == TransferState.KV_LOADED
    np.testing.assert_array_equal(d.kv("r1", 22), expected_kv(3, 4, 22))
    c = counters(d)
    assert c["kv_blocks_read"] == 3 and c["kv_blocks_read_skipped"] == 3
    kv_bytes_per_block = 2 * 2 * 4 * BLOCK_SIZE * 2 * 4  # layers, K/V, heads, tokens, dim, float32
    assert sum(t["num_bytes"] for t in d.connector.consumer.transfers) == 3 * kv_bytes_per_block
    d.finish("r1")
    world.run()
    assert p.pool.num_free_blocks == p.pool.num_blocks  # every expected read was notified


def test_a_full_hit_reads_nothing_and_frees_the_producer_at_once(world):
    p, d = pair(world)
    params = p.prefill("p1", 16, seed=4)  # exactly 4 full blocks
    d.receive("r1", params)
    held = cached_blocks(d, 4, seed=4)
    d.admit("r1", 16, cached=held)
    assert d.outcome("r1").state == TransferState.KV_LOADED  # at admission: no handshake, no READ
    world.run(2)
    assert p.pool.num_free_blocks == p.pool.num_blocks and not p.connector.producer.has_leases
    c = counters(d)
    assert c["kv_blocks_read"] == 0 and c["kv_blocks_read_skipped"] == 4 and c["kv_transfers"] == 0
    np.testing.assert_array_equal(d.kv("r1", 16), expected_kv(4, 4, 16))


def test_a_read_failing_into_a_request_never_touches_its_shared_blocks(world):
    p, d = pair(world, transfer_timeout_s=2.0)
    world.fabric.hang_reads = True  # the READ times out: its blocks are in doubt
    d.receive("r1", p.prefill("p1", 20, seed=5))
    held = cached_blocks(d, 2, seed=5)
    d.pool.take(held)  # another request (or the prefix cache's owner) holds them too
    blocks = d.admit("r1", 20, cached=held)
    world.run(steps=5, advance_s=1.0)
    o = d.outcome("r1")
    assert o.state == TransferState.FAILED and o.quarantine_until is not None
    quarantined = {b for _, q in d.pool.quarantine for b in q}
    assert quarantined == set(blocks[2:5])  # the READ's own blocks, not the shared ones
    assert not quarantined & set(held)
    assert all(d.pool.ref_counts[b] == 2 for b in held)  # only the failed request's reference went


def test_recompute_after_a_failed_delta_read_keeps_the_shared_blocks(world):
    p, d = pair(world, failure_policy="recompute")
    world.fabric.fail_reads = True
    d.receive("r1", p.prefill("p1", 20, seed=6))
    held = cached_blocks(d, 2, seed=6)
    d.admit("r1", 20, cached=held)
    world.run()
    assert d.outcome("r1").state == TransferState.RECOMPUTING
    assert not d.pool.quarantine and all(d.pool.ref_counts[b] == 1 for b in held)
    d.blocks["held"] = held
    np.testing.assert_array_equal(d.kv("held", 8), expected_kv(6, 4, 8))  # still there, unchanged
