"""Lease rules (docs/design.md, "Block lifecycle"): a set of expected reads, not a count; expiry; release; one owner."""

from __future__ import annotations

from pdserve.kv_transfer.leases import LeaseTable
from pdserve.kv_transfer.messages import Notification, NotificationKind


def note(rid: str, rank: int, tp: int = 2, engine: str = "d", kind=NotificationKind.DONE):
    return Notification(rid, engine, rank, tp, kind)


def test_duplicates_cannot_free_early():
    t = LeaseTable(lease_s=10, producer_tp_size=2, num_kv_heads=2)  # P TP 2, D TP 2: (0,0), (1,1)
    t.add("r", [1, 2], now=0)
    assert t.notify(0, note("r", 0))
    assert t.notify(0, note("r", 0))  # the same read reported twice
    assert t.collect(now=1) == ([], [])
    assert not t.notify(1, note("r", 0))  # consumer rank 0 never reads producer rank 1
    assert t.notify(1, note("r", 1))
    free, expired = t.collect(now=1)
    assert [l.request_id for l in free] == ["r"] and not expired


def test_expiry_and_heartbeat_renewal():
    t = LeaseTable(lease_s=5, producer_tp_size=1, num_kv_heads=2)
    t.add("a", [1], now=0)
    t.add("b", [2], now=0)
    assert t.heartbeat("d", 1, ["a", "zzz"], now=4) == [True, False]
    free, expired = t.collect(now=6)
    assert not free and [l.request_id for l in expired] == ["b"]
    assert t.heartbeat("d", 1, ["b"], now=6) == [False]
    _, expired = t.collect(now=9.5)
    assert [l.request_id for l in expired] == ["a"] and t.num_expired == 2


def test_release_and_owner():
    t = LeaseTable(lease_s=5, producer_tp_size=1, num_kv_heads=2)
    t.add("a", [1], now=0)
    assert t.heartbeat("d1", 1, ["a"], now=1) == [True]
    assert t.heartbeat("d2", 1, ["a"], now=1) == [False]  # another consumer cannot renew it
    assert t.release("d2", ["a"]) == 0
    assert not t.notify(0, note("a", 0, tp=1, engine="d2"))
    assert t.release("d1", ["a"]) == 1
    free, _ = t.collect(now=2)
    assert [l.request_id for l in free] == ["a"]
    assert not t.notify(0, note("a", 0, tp=1, engine="d1"))  # late: ignored
    assert t.num_ignored == 2


def test_abort_notification_releases():
    t = LeaseTable(lease_s=5, producer_tp_size=1, num_kv_heads=2)
    t.add("a", [1], now=0)
    assert t.notify(0, note("a", 0, tp=1, kind=NotificationKind.ABORT))
    assert [l.request_id for l in t.collect(now=1)[0]] == ["a"]
