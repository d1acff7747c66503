"""Lease rules (docs/design.md, "Block lifecycle"): a set of expected reads, not a count; expiry;
release; one owner, who must show the params the lease was issued with; notifications only from
that owner's agents."""

from __future__ import annotations

import pytest

from pdserve.kv_transfer.leases import LeaseTable
from pdserve.kv_transfer.messages import LeaseAnswer, Notification, NotificationKind

HELD, GONE, MISMATCH, TAKEN = LeaseAnswer.HELD, LeaseAnswer.GONE, LeaseAnswer.MISMATCH, LeaseAnswer.TAKEN


def note(rid: str, rank: int, tp: int = 2, engine: str = "d", kind=NotificationKind.DONE):
    return Notification(rid, engine, rank, tp, kind)


def bound(table: LeaseTable, rid: str, engine: str = "d", tp: int = 2) -> None:
    assert table.heartbeat(engine, tp, [rid], [f"digest-{rid}"], now=0) == [HELD]


def test_duplicates_cannot_free_early():
    t = LeaseTable(lease_s=10, producer_tp_size=2, num_kv_heads=2)  # P TP 2, D TP 2: (0,0), (1,1)
    t.add("r", [1, 2], "digest-r", now=0)
    bound(t, "r")
    assert t.notify(0, "d/rank0", note("r", 0))
    assert t.notify(0, "d/rank0", note("r", 0))  # the same read reported twice
    assert t.collect(now=1) == ([], [])
    assert not t.notify(1, "d/rank0", note("r", 0))  # consumer rank 0 never reads producer rank 1
    assert t.notify(1, "d/rank1", note("r", 1))
    free, expired = t.collect(now=1)
    assert [l.request_id for l in free] == ["r"] and not expired


def test_notifications_count_only_from_the_bound_consumers_agents():
    t = LeaseTable(lease_s=10, producer_tp_size=1, num_kv_heads=2)
    t.add("r", [1], "digest-r", now=0)
    assert not t.notify(0, "d/rank0", note("r", 0, tp=1))  # nobody bound it yet
    bound(t, "r", tp=1)
    assert not t.notify(0, "intruder/rank0", note("r", 0, tp=1))  # a stranger claims d's read
    assert not t.notify(0, "d/rank1", note("r", 0, tp=1))  # d's other rank claims rank 0's
    assert t.collect(now=1) == ([], [])
    assert t.notify(0, "d/rank0", note("r", 0, tp=1))
    assert [l.request_id for l in t.collect(now=1)[0]] == ["r"] and t.num_ignored == 3


def test_expiry_and_heartbeat_renewal():
    t = LeaseTable(lease_s=5, producer_tp_size=1, num_kv_heads=2)
    t.add("a", [1], "digest-a", now=0)
    t.add("b", [2], "digest-b", now=0)
    assert t.heartbeat("d", 1, ["a", "zzz"], ["digest-a", "x"], now=4) == [HELD, GONE]
    free, expired = t.collect(now=6)
    assert [l.request_id for l in free] == ["b"] and not expired  # nobody bound b: nothing to quarantine
    assert t.heartbeat("d", 1, ["b"], ["digest-b"], now=6) == [GONE]
    _, expired = t.collect(now=9.5)
    assert [l.request_id for l in expired] == ["a"] and t.num_expired == 2


def test_a_lease_answers_only_to_its_own_params_and_owner():
    t = LeaseTable(lease_s=5, producer_tp_size=1, num_kv_heads=2)
    t.add("a", [1], "digest-a", now=0)
    assert t.heartbeat("d1", 1, ["a"], ["digest-of-other-blocks"], now=1) == [MISMATCH]
    assert t.heartbeat("d1", 1, ["a"], [], now=1) == [MISMATCH]  # no digest at all
    assert t.heartbeat("d1", 1, ["a"], ["digest-a"], now=1) == [HELD]
    assert t.heartbeat("d2", 1, ["a"], ["digest-a"], now=1) == [TAKEN]  # another consumer
    assert t.release("d2", ["a"]) == 0
    assert not t.notify(0, "d2/rank0", note("a", 0, tp=1, engine="d2"))
    assert t.release("d1", ["a"]) == 1
    free, _ = t.collect(now=2)
    assert [l.request_id for l in free] == ["a"]
    assert not t.notify(0, "d1/rank0", note("a", 0, tp=1, engine="d1"))  # late: ignored
    assert t.num_ignored == 2


def test_abort_notification_releases():
    t = LeaseTable(lease_s=5, producer_tp_size=1, num_kv_heads=2)
    t.add("a", [1], "digest-a", now=0)
    bound(t, "a", tp=1)
    assert t.notify(0, "d/rank0", note("a", 0, tp=1, kind=NotificationKind.ABORT))
    assert [l.request_id for l in t.collect(now=1)[0]] == ["a"]


def test_an_expired_lease_is_quarantined_only_if_a_consumer_bound_it():
    """Only a bound consumer can have a READ in flight (it posts READs within its acknowledged
    heartbeats), so an expired lease nobody spoke for is freed at once."""
    t = LeaseTable(lease_s=5, producer_tp_size=1, num_kv_heads=2)
    t.add("unbound", [1, 2], "digest-unbound", now=0)
    t.add("bound", [3], "digest-bound", now=0)
    bound(t, "bound", tp=1)
    free, expired = t.collect(now=5)
    assert [l.request_id for l in free] == ["unbound"] and [l.request_id for l in expired] == ["bound"]
    assert t.num_expired == 2


def test_a_hand_off_whose_answer_was_not_delivered_releases_only_an_unbound_lease():
    t = LeaseTable(lease_s=5, producer_tp_size=1, num_kv_heads=2)
    t.add("left", [1], "digest-left", now=0)
    t.add("read", [2], "digest-read", now=0)
    bound(t, "read", tp=1)
    assert t.release_undelivered("left")
    assert not t.release_undelivered("read")  # a consumer holds it: that consumer decides
    assert not t.release_undelivered("left") and not t.release_undelivered("unknown")
    assert [l.request_id for l in t.collect(now=1)[0]] == ["left"] and t.num_released == 1


def test_a_live_lease_is_never_replaced():
    t = LeaseTable(lease_s=30.0, producer_tp_size=1, num_kv_heads=4)
    t.add("r1", [1, 2], "d", now=0.0)
    with pytest.raises(AssertionError, match="its blocks would leak"):
        t.add("r1", [3], "d", now=1.0)
    assert t.num_blocks == 2
