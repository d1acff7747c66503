"""The consumer role on the loopback transport: every failure of the contract ends in one clear
outcome, the producer is released, no block leaks, and in-doubt blocks are never reused."""

from __future__ import annotations

import numpy as np
import pytest

from harness import expected_kv
from pdserve.kv_transfer.transfer_state import TransferState
from pdserve.kv_transfer.topology import producer_ranks_for
from pdserve.sampling_params import InvalidRequestError


def pair(world, p_tp=1, d_tp=1, **kw):
    return world.instance("P", p_tp, **kw), world.instance("D", d_tp, **kw)


def transfer(world, p, d, rid="r1", num_tokens=10, seed=1, steps=6):
    params = p.prefill(f"p-{rid}", num_tokens, seed)
    d.receive(rid, params)
    d.admit(rid, num_tokens)
    world.run(steps)
    return params


def assert_idle(*instances):
    for inst in instances:
        assert inst.pool.num_free_blocks == inst.pool.num_blocks, inst.engine_id
        assert not inst.connector.producer.has_leases and not inst.connector.consumer.loads


@pytest.mark.parametrize("p_tp, d_tp, heads", [(1, 1, 4), (1, 2, 4), (2, 1, 4), (2, 2, 4), (1, 4, 4),
                                               (4, 1, 4), (2, 4, 4), (4, 2, 4), (1, 2, 1), (2, 1, 1),
                                               (4, 2, 2)])
def test_the_consumer_gets_exactly_the_producers_kv(world, p_tp, d_tp, heads):
    p, d = pair(world, p_tp, d_tp, num_kv_heads=heads)
    transfer(world, p, d, num_tokens=13, seed=3)
    assert d.outcome("r1").state == TransferState.KV_LOADED
    np.testing.assert_array_equal(d.kv("r1", 13), expected_kv(3, heads, 13))
    asked = world.network.sent[0].ranks  # only the producer ranks decode's ranks read from
    assert asked == sorted({r for c in range(d_tp) for r in producer_ranks_for(c, p_tp, d_tp, heads)})
    d.finish("r1")
    world.run(2)
    assert_idle(p, d)  # every expected read notified: the producer freed the lease


def test_one_handshake_per_producer_engine(world):
    p, d = pair(world)
    for i in range(3):
        d.receive(f"r{i}", p.prefill(f"p{i}", 6, seed=i + 1))
    for i in range(3):
        d.admit(f"r{i}", 6)
    world.run()
    kinds = [type(m).__name__ for m in world.network.sent]
    assert kinds.count("HandshakeRequest") == 1
    assert all(d.outcome(f"r{i}").state == TransferState.KV_LOADED for i in range(3))
    assert d.connector.stats(False)["counters"]["nixl_handshakes"] == 1


def test_a_request_queued_longer_than_the_lease_keeps_it(world):
    """Heartbeats start when the params are accepted, not when the request is admitted."""
    p, d = pair(world, lease_s=3.0)
    d.receive("r1", p.prefill("p1", 9))
    world.run(steps=10, advance_s=1.0)  # 10 s in decode's queue: three leases long
    d.admit("r1", 9)
    world.run()
    assert d.outcome("r1").state == TransferState.KV_LOADED
    np.testing.assert_array_equal(d.kv("r1", 9), expected_kv(1, 4, 9))


def test_a_lease_that_expired_fails_the_request_and_releases_nothing_twice(world):
    p, d = pair(world, lease_s=2.0)
    params = p.prefill("p1", 9)
    world.run(steps=3, advance_s=1.0)  # no consumer heartbeats: the lease ends
    assert p.pool.num_free_blocks == p.pool.num_blocks  # nobody bound it: freed, no quarantine
    d.receive("r1", params)
    d.admit("r1", 9)
    world.run()
    o = d.outcome("r1")
    assert o.state == TransferState.FAILED and "no longer holds the KV" in o.message
    world.run(steps=3, advance_s=20.0)  # quarantine over
    assert_idle(p, d)


def test_an_unreachable_producer_fails_within_the_handshake_timeout(world):
    p, d = pair(world, handshake_timeout_s=2.0)
    params = {**p.prefill("p1", 9), "remote_port": 1, "remote_engine_id": "ghost"}
    d.receive("r1", params)
    d.admit("r1", 9)
    world.run(steps=4, advance_s=1.0)
    o = d.outcome("r1")
    assert o.state == TransferState.FAILED and "unreachable" in o.message
    assert not d.connector.consumer.peers.peers  # the next request naming it handshakes again


def test_an_incompatible_producer_is_named(world):
    p = world.instance("P", 1, model="other-model")
    d = world.instance("D", 1)
    d.receive("r1", p.prefill("p1", 9))
    d.admit("r1", 9)
    world.run()
    o = d.outcome("r1")
    assert o.state == TransferState.FAILED and "incompatible producer" in o.message and "model" in o.message
    world.run(2)
    assert_idle(p, d)  # the producer was told to release at once


def test_a_wrong_tp_size_is_refused_at_the_edge_once_the_producer_is_known(world):
    p, d = pair(world, 2, 1)
    transfer(world, p, d, "r1")
    params = {**p.prefill("p2", 9), "tp_size": 1}
    with pytest.raises(InvalidRequestError) as e:
        d.receive("r2", params)
    assert e.value.field == "kv_transfer_params.tp_size"


def test_a_wrong_tp_size_in_the_first_request_fails_only_that_request(world):
    p, d = pair(world, 2, 1)
    bad = {**p.prefill("p1", 9, seed=1), "tp_size": 1}
    good = p.prefill("p2", 9, seed=2)
    d.receive("bad", bad)
    d.receive("good", good)
    d.admit("bad", 9)
    d.admit("good", 9)
    world.run(10)
    assert d.outcome("bad").state == TransferState.FAILED and "tp_size" in d.outcome("bad").message
    assert d.outcome("good").state == TransferState.KV_LOADED
    np.testing.assert_array_equal(d.kv("good", 9), expected_kv(2, 4, 9))


def test_a_transfer_error_fails_the_request_and_evicts_the_producer(world):
    p, d = pair(world)
    transfer(world, p, d, "warm")
    world.fabric.fail_reads = True
    transfer(world, p, d, "r1")
    o = d.outcome("r1")
    assert o.state == TransferState.FAILED and "failed" in o.message and o.quarantine_until is None
    assert "P" not in d.connector.consumer.peers.peers
    world.fabric.fail_reads = False
    transfer(world, p, d, "r2", seed=5)  # handshakes again, then works
    assert d.outcome("r2").state == TransferState.KV_LOADED


def test_a_producer_dying_mid_read_quarantines_the_blocks_it_may_still_write(world):
    p, d = pair(world, transfer_timeout_s=2.0)
    world.fabric.hang_reads = True
    transfer(world, p, d, "r1")
    world.fabric.lose(p.workers[0].agent.name)
    world.run(steps=2)
    o = d.outcome("r1")
    assert o.state == TransferState.FAILED and o.quarantine_until is None  # ERR: the READ is over


def test_a_read_that_times_out_is_in_doubt_and_its_blocks_are_never_reused(world):
    p, d = pair(world, transfer_timeout_s=2.0, num_blocks=8)
    world.fabric.hang_reads = True
    transfer(world, p, d, "r1", num_tokens=10, seed=1)
    doubtful = list(d.blocks["r1"])
    world.run(steps=4, advance_s=1.0)
    o = d.outcome("r1")
    assert o.state == TransferState.FAILED and o.quarantine_until is not None and "timed out" in o.message
    world.fabric.hang_reads = False
    reused = d.pool.allocate(d.pool.num_free_blocks)  # every block decode can hand out now
    assert not set(reused) & set(doubtful)
    world.fabric.land_hung()  # the late READ lands in the quarantined blocks only
    d.pool.release(reused)
    world.run(steps=4, advance_s=5.0)  # quarantine (2 x transfer timeout) over
    assert d.pool.num_free_blocks == d.pool.num_blocks


def test_no_read_is_posted_after_the_lease_deadline(world):
    """The consumer's deadline is the acknowledged lease minus a margin; a READ that would be posted
    later is refused on the rank, and the request fails (the producer may have reused the blocks)."""
    p, d = pair(world, lease_s=1.0)
    d.receive("r1", p.prefill("p1", 9))
    world.run(2)  # handshake and the first acknowledgement
    world.network.drop = True  # no further heartbeat gets through
    world.clock.advance(0.95)  # past sent_at + lease - 10 %: the READ would race the expiry
    d.admit("r1", 9)
    world.run(1)
    o = d.outcome("r1")
    assert o is not None and o.state == TransferState.FAILED and "deadline" in o.message
    assert world.fabric.num_reads == 0


def test_client_cancel_while_queued_releases_the_producer_at_once(world):
    p, d = pair(world)
    d.receive("r1", p.prefill("p1", 9))
    world.run(2)
    assert not d.connector.abort("r1")  # nothing in flight: the engine ends it now
    d.finish("r1")
    world.run(2)
    assert p.connector.producer.leases.num_released == 1
    assert_idle(p, d)


def test_client_cancel_while_reading_waits_for_the_read(world):
    p, d = pair(world)
    world.fabric.read_delay_s = 0.5
    transfer(world, p, d, "r1", steps=3)
    assert d.connector.abort("r1")  # a READ is in flight: wait for it
    world.run(steps=3, advance_s=0.5)
    assert d.outcome("r1").state == TransferState.ABORTED
    world.run(2)
    assert_idle(p, d)


def test_recompute_policy(world):
    p = world.instance("P", 1)
    d = world.instance("D", 1, failure_policy="recompute", handshake_timeout_s=1.0)
    params = {**p.prefill("p1", 9), "remote_port": 1, "remote_engine_id": "ghost"}
    d.receive("r1", params)
    world.run(steps=3, advance_s=1.0)
    assert d.outcome("r1").state == TransferState.RECOMPUTING  # still queued: it just prefills here


def test_params_are_used_once(world):
    p, d = pair(world)
    params = transfer(world, p, d, "r1")
    with pytest.raises(InvalidRequestError) as e:
        d.receive("r2", params)
    assert e.value.field == "kv_transfer_params.remote_request_id"


def test_swapped_block_ids_are_refused_by_the_lease_even_without_a_secret(world):
    """B's params with A's block ids (no secret, so nothing signed): the heartbeat shows the params'
    digest, B's lease answers MISMATCH, and nothing is read."""
    p, d = pair(world)
    pa, pb = p.prefill("pA", 9, seed=1), p.prefill("pB", 9, seed=2)
    d.receive("r1", {**pb, "remote_block_ids": pa["remote_block_ids"]})
    d.admit("r1", 9)
    world.run()
    o = d.outcome("r1")
    assert o.state == TransferState.FAILED and "other params" in o.message
    assert world.fabric.num_reads == 0


def test_block_ids_beyond_the_producers_pool_fail_after_the_handshake(world):
    """A producer whose handshake shows a smaller pool than the block ids it issued."""
    import msgspec
    p, d = pair(world)
    params = p.prefill("p1", 9)
    producer = p.connector.producer
    producer.rank_agents = [msgspec.structs.replace(ra, num_blocks=1) for ra in producer.rank_agents]
    d.receive("r1", params)
    d.admit("r1", 9)
    world.run()
    o = d.outcome("r1")
    assert o.state == TransferState.FAILED and "beyond the producer's pool" in o.message
    assert world.fabric.num_reads == 0


def test_signed_params_cannot_be_changed(world):
    p = world.instance("P", 1, secret=b"s")
    d = world.instance("D", 1, secret=b"s")
    params = p.prefill("p1", 9)
    for change in ({"remote_block_ids": [5, 6, 7]}, {"remote_port": 1}, {"signature": "00"}):
        with pytest.raises(InvalidRequestError) as e:
            d.receive("r1", {**params, **change})
        assert e.value.field == "kv_transfer_params.signature"
    unsigned = {k: v for k, v in params.items() if k != "signature"}
    with pytest.raises(InvalidRequestError, match="required"):
        d.receive("r1", unsigned)
    assert not world.network.sent or all(type(m).__name__ != "HandshakeRequest" for m in world.network.sent)
    d.receive("r1", params)
    d.admit("r1", 9)
    world.run()
    assert d.outcome("r1").state == TransferState.KV_LOADED


def test_a_consumer_dials_only_its_configured_producers(world):
    p = world.instance("P", 1)
    d = world.instance("D", 1, producers=("10.0.0.9:5600",))
    with pytest.raises(InvalidRequestError) as e:
        d.receive("r1", p.prefill("p1", 9))
    assert e.value.field == "kv_transfer_params.remote_host" and not world.network.sent
    ok = world.instance("D2", 1, producers=(f"127.0.0.1:{p.connector.producer.server.port}",))
    ok.receive("r2", p.prefill("p2", 9))
    ok.admit("r2", 9)
    world.run()
    assert ok.outcome("r2").state == TransferState.KV_LOADED
