"""The producer role on the loopback transport: what it hands off, and when a lease's blocks come
back (every expected read, release, expiry then quarantine), never early."""

from __future__ import annotations

import msgspec

from harness import BLOCK_SIZE
from pdserve.kv_transfer.messages import (HANDSHAKE_VERSION, HandshakePayload, HandshakeRequest, Heartbeat, HeartbeatAck,
                                          LeaseAnswer, Notification, NotificationKind,
                                          ReceivedNotification, Release, ReleaseAck)
from pdserve.kv_transfer.transfer_state import TransferState
from pdserve.kv_transfer.params import KVTransferParams, prompt_hash


def _free(instance) -> set[int]:
    return set(instance.pool.free) | set(instance.pool.spare)


def test_hand_off_keeps_the_prompts_blocks_and_answers_with_params(world):
    p = world.instance("P", 2)
    params = p.prefill("req", 10)  # 10 tokens + the first token's slot: 3 blocks, 3 kept
    kv = KVTransferParams.parse(params)
    assert kv.do_remote_prefill and kv.remote_engine_id == "P" and kv.producer_tp_size == 2
    assert kv.remote_request_id == "req" and kv.prompt_hash == prompt_hash(list(range(10)))
    assert len(kv.remote_block_ids) == 3 and kv.first_token.token_id == 7
    assert kv.remote_port == p.connector.producer.server.port and kv.lease_s == p.config.lease_s
    assert p.pool.num_free_blocks == p.pool.num_blocks - 3
    p.prefill("req2", 2 * BLOCK_SIZE)  # the first token's slot is a block of its own: given back
    assert p.pool.num_free_blocks == p.pool.num_blocks - 5


def test_duplicate_notifications_cannot_free_a_lease_early(world):
    """P TP 2 -> D TP 1: consumer rank 0 reads from both producer ranks. Its DONE to producer rank 0,
    delivered twice before anything else, is one read of the two."""
    p = world.instance("P", 2)
    d = world.instance("D", 1)
    params = p.prefill("p1", 9)
    d.receive("r1", params)
    world.run(2)  # the first heartbeat binds the lease to D; nothing is read yet
    note = msgspec.msgpack.encode(Notification("p1", "D", 0, 1, NotificationKind.DONE))
    for _ in range(2):
        world.fabric.forge("P/rank0", "D/rank0", note)
    world.run(2)
    assert not set(params["remote_block_ids"]) & _free(p)
    world.fabric.duplicate_notifications = True
    d.admit("r1", 9)
    world.run()
    assert d.outcome("r1").state == TransferState.KV_LOADED
    d.finish("r1")
    world.run(2)
    assert p.pool.num_free_blocks == p.pool.num_blocks


def test_a_lease_waits_for_every_expected_read(world):
    p = world.instance("P", 2)
    world.instance("D", 1)
    params = p.prefill("p1", 9)
    producer = p.connector.producer
    digest = KVTransferParams.parse(params).lease_digest()
    assert producer._handle(Heartbeat("D", 1, ["p1"], [digest])).alive == [True]  # D binds the lease
    done0 = ReceivedNotification(0, "D/rank0", Notification("p1", "D", 0, 1, NotificationKind.DONE))
    for _ in range(3):  # the same read reported three times
        producer.process_notifications([done0], 0)
    p.step()
    assert not set(params["remote_block_ids"]) & _free(p)
    done1 = ReceivedNotification(1, "D/rank0", Notification("p1", "D", 0, 1, NotificationKind.DONE))
    producer.process_notifications([done1], 0)
    p.step()
    assert set(params["remote_block_ids"]) <= _free(p)


def test_release_frees_at_once_and_only_for_the_lease_owner(world):
    p = world.instance("P", 1)
    params = p.prefill("p1", 9)
    producer = p.connector.producer
    digest = KVTransferParams.parse(params).lease_digest()
    assert producer._handle(Heartbeat("D", 1, ["p1"], [digest])).alive == [True]
    assert producer._handle(Release("intruder", ["p1"], "x")) == ReleaseAck(0)
    p.step()
    assert not set(params["remote_block_ids"]) & _free(p)
    assert producer._handle(Release("D", ["p1"], "client left")) == ReleaseAck(1)
    p.step()
    assert p.pool.num_free_blocks == p.pool.num_blocks


def test_expiry_quarantines_then_frees(world):
    """A consumer that dies before reading: the lease expires, the blocks are quarantined for
    twice the transfer timeout, then free."""
    p = world.instance("P", 1, lease_s=2.0, transfer_timeout_s=3.0)
    d = world.instance("D", 1)
    d.receive("r1", p.prefill("p1", 9))
    world.run(2)
    assert p.connector.producer.leases.num_heartbeats >= 1
    world.instances.remove(d)  # the consumer process is gone: no more heartbeats
    world.run(steps=3, advance_s=1.0)
    assert p.connector.producer.leases.num_expired == 1 and p.pool.num_quarantined_blocks == 3
    world.run(steps=2, advance_s=3.0)
    assert p.pool.num_quarantined_blocks == 3  # 2 x 3 s not over yet
    world.run(steps=2, advance_s=3.0)
    assert p.pool.num_free_blocks == p.pool.num_blocks
    world.instances.append(d)


def test_a_lease_no_consumer_ever_bound_is_freed_at_expiry_without_quarantine(world):
    p = world.instance("P", 1, lease_s=2.0, transfer_timeout_s=3.0)
    p.prefill("p1", 9)
    world.run(steps=3, advance_s=1.0)
    assert p.connector.producer.leases.num_expired == 1
    assert p.pool.num_quarantined_blocks == 0 and p.pool.num_free_blocks == p.pool.num_blocks


def test_an_undelivered_hand_off_frees_its_lease_at_once_unless_a_consumer_holds_it(world):
    p = world.instance("P", 1)
    p.prefill("p1", 9)
    assert p.connector.release_undelivered("p1")  # the producer's client left: nobody has the params
    p.step()
    assert p.pool.num_free_blocks == p.pool.num_blocks
    d = world.instance("D", 1)
    d.receive("r2", p.prefill("p2", 9))
    world.run(2)  # D's heartbeat binds the lease
    assert not p.connector.release_undelivered("p2")
    p.step()
    assert p.pool.num_free_blocks < p.pool.num_blocks
    assert not p.connector.release_undelivered("never-handed-off")


def test_the_handshake_answers_only_the_ranks_asked(world):
    p = world.instance("P", 4)
    reply = p.connector.producer._handle(HandshakeRequest(HANDSHAKE_VERSION, "P", [2, 3]))
    assert not reply.error
    payload = msgspec.msgpack.decode(reply.payload, type=HandshakePayload)
    assert payload.producer_tp_size == 4 and [r.rank for r in payload.ranks] == [2, 3]
    assert p.connector.producer.num_handshakes_served == 1


def test_heartbeat_ack_carries_lease_and_quarantine(world):
    p = world.instance("P", 1, lease_s=7.0, transfer_timeout_s=2.0)
    digest = KVTransferParams.parse(p.prefill("p1", 5)).lease_digest()
    ack = p.connector.producer._handle(Heartbeat("D", 1, ["p1", "unknown"], [digest, "x"]))
    assert ack == HeartbeatAck([LeaseAnswer.HELD, LeaseAnswer.GONE], 7.0, 4.0)
