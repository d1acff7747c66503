"""A consumer rank's READs on the loopback transport: split across copy lanes, DONE only once every
part has landed, a lane that times out leaves the READ in doubt, eviction waits for READs."""

from __future__ import annotations

import numpy as np

from harness import BLOCK_SIZE, expected_kv
from pdserve.kv_transfer.lanes import LANE_MIN_BYTES
from pdserve.kv_transfer.transfer_state import TransferState

BIG = 8192  # tokens: 128 bytes of KV each, a READ of 1 MiB: split across two lanes


def lanes_pair(world, **kw):
    p = world.instance("P", 1, num_blocks=2100, **kw)
    d = world.instance("D", 1, num_blocks=2100, copy_lanes=2, **kw)
    return p, d


def test_a_read_split_across_lanes_lands_whole(world):
    p, d = lanes_pair(world)
    d.receive("r1", p.prefill("p1", BIG, seed=4))
    d.admit("r1", BIG)
    world.run()
    assert d.outcome("r1").state == TransferState.KV_LOADED
    np.testing.assert_array_equal(d.kv("r1", BIG), expected_kv(4, 4, BIG))
    reader = d.workers[0].reader
    assert world.fabric.num_reads == 2 and not reader.inflight  # one part per lane
    assert world.fabric.num_bytes_read >= LANE_MIN_BYTES


def test_the_producer_hears_done_only_once_every_part_has_landed(world):
    p, d = lanes_pair(world)
    lane = d.workers[0].reader.lanes[0]
    world.fabric.hang_readers.add(lane.agent.name)
    params = p.prefill("p1", BIG)
    d.receive("r1", params)
    d.admit("r1", BIG)
    world.run()
    assert d.outcome("r1") is None  # the lane's part is still in flight
    assert p.connector.producer.leases._leases["p1"].received == set()  # no DONE yet
    world.fabric.land_hung()
    world.run(2)
    assert d.outcome("r1").state == TransferState.KV_LOADED
    d.finish("r1")
    world.run(2)
    assert p.pool.num_free_blocks == p.pool.num_blocks


def test_a_lane_part_that_times_out_leaves_the_read_in_doubt(world):
    p, d = lanes_pair(world, transfer_timeout_s=2.0)
    world.fabric.hang_readers.add(d.workers[0].reader.lanes[0].agent.name)
    d.receive("r1", p.prefill("p1", BIG))
    blocks = d.admit("r1", BIG)
    world.run(steps=5, advance_s=1.0)
    o = d.outcome("r1")
    assert o.state == TransferState.FAILED and o.quarantine_until is not None, o
    read_into = blocks[:-(-BIG // BLOCK_SIZE)]  # the first token's own block was never READ into
    assert set(read_into) == {b for _, q in d.pool.quarantine for b in q}


def test_a_read_from_a_producer_the_rank_never_loaded_fails_cleanly(world):
    from pdserve.kv_transfer.messages import ConnectorMetadata, ReadSpec
    d = world.instance("D", 1)
    w = d.workers[0]
    w.start_step(ConnectorMetadata("D", reads=[ReadSpec("r", "ghost", "x", [0], [0], 1e12, 5.0)]))
    w.run_once()
    failure = w.report().failed[0]
    assert failure.peer_gone and "not loaded" in failure.reason


def test_an_evicted_producer_is_dropped_once_its_reads_end(world):
    from pdserve.kv_transfer.messages import ConnectorMetadata
    p = world.instance("P", 1)
    d = world.instance("D", 1)
    world.fabric.read_delay_s = 1.0
    d.receive("r1", p.prefill("p1", 9))
    d.admit("r1", 9)
    world.run(3)
    reader, agent = d.workers[0].reader, d.workers[0].agent
    assert reader.inflight and "P" in reader.peers
    d.workers[0].start_step(ConnectorMetadata("D", evict_peers=["P"]))
    d.workers[0].run_once()
    assert "P" in reader.peers and agent.peers  # a READ still uses it
    world.clock.advance(1.0)
    d.workers[0].run_once()
    assert "P" not in reader.peers and not agent.peers


def test_undecodable_notifications_are_counted(world):
    p = world.instance("P", 1)
    world.instance("D", 1)
    p.prefill("p1", 9)
    world.fabric.forge("P/rank0", "D/rank0", b"\xc1 not msgpack")
    world.run(2)
    assert p.connector.stats(False)["counters"]["nixl_num_failed_notifications"] == 1
