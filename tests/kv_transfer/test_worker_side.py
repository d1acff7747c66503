"""The worker side of one rank: its registration, metadata in, reports out, the thread that makes
every transport call, and notifications passed up with their sender."""

from __future__ import annotations

import time

import msgspec
import numpy as np

from harness import Clock, _registered
from pdserve.config import KVTransferConfig
from pdserve.kv_transfer.messages import ConnectorMetadata, Notification, NotificationKind
from pdserve.kv_transfer.worker_side import WorkerConnector
from pdserve.transport.loopback import LoopbackFabric


def cache() -> np.ndarray:
    return np.zeros((2, 2, 8, 2, 4, 2), np.float32)


def test_registration_describes_the_cache_a_peer_reads():
    fabric = LoopbackFabric()
    c = cache()
    w = WorkerConnector(KVTransferConfig(), 4, 1, 2, _registered(c), "E", fabric.agent, threaded=False)
    ra = w.rank_agent()
    assert ra.rank == 1 and ra.agent_name == "E/rank1" and ra.num_blocks == 8 and ra.num_kv_heads == 2
    assert ra.region_addresses[0] == c.ctypes.data and len(ra.region_addresses) == 4
    assert ra.block_bytes == 2 * ra.head_bytes == c[0, 0, 0].nbytes
    assert fabric.agents["E/rank1"].regions == [(c.ctypes.data, c.nbytes)]
    w.close()
    assert "E/rank1" not in fabric.agents


def test_notifications_are_polled_only_while_leases_are_held_and_carry_their_sender():
    fabric = LoopbackFabric(Clock())
    w = WorkerConnector(KVTransferConfig(), 4, 0, 1, _registered(cache()), "P", fabric.agent, threaded=False)
    note = msgspec.msgpack.encode(Notification("p1", "D", 0, 1, NotificationKind.DONE))
    fabric.forge("P/rank0", "D/rank0", note)
    w.run_once()
    assert w.report().notifications == []  # nothing leased: nobody polls
    w.start_step(ConnectorMetadata("P", poll_notifications=True))
    w.run_once()
    received = w.report().notifications
    assert [(r.producer_rank, r.sender, r.notification.producer_request_id) for r in received] == \
        [(0, "D/rank0", "p1")]
    w.close()


def test_the_thread_sleeps_when_idle_and_serves_a_step_when_woken():
    fabric = LoopbackFabric()
    w = WorkerConnector(KVTransferConfig(), 4, 0, 1, _registered(cache()), "P", fabric.agent)
    try:
        fabric.forge("P/rank0", "D/rank0", b"\xc1")
        w.start_step(ConnectorMetadata("P", poll_notifications=True))
        deadline = time.monotonic() + 5
        while w.report().num_bad_notifications == 0:
            assert time.monotonic() < deadline
            time.sleep(0.001)
    finally:
        w.close()
    assert not w._thread.is_alive()


def test_a_rank_with_something_to_report_wakes_the_engine_once_per_report():
    """A notification (or a READ's end) reaches an engine that is not stepping: the rank announces
    its report when it gets its first item, and again only after the engine took it."""
    fabric = LoopbackFabric(Clock())
    announced = []
    w = WorkerConnector(KVTransferConfig(), 4, 0, 1, _registered(cache()), "P", fabric.agent, threaded=False,
                        on_report=lambda: announced.append(1))
    w.start_step(ConnectorMetadata("P", poll_notifications=True))
    w.run_once()
    assert announced == []  # nothing to report: the engine sleeps
    for i in range(3):
        fabric.forge("P/rank0", "D/rank0", msgspec.msgpack.encode(Notification(f"p{i}", "D", 0, 1,
                                                                               NotificationKind.DONE)))
        w.run_once()
    assert len(announced) == 1
    assert len(w.report().notifications) == 3
    fabric.forge("P/rank0", "D/rank0", b"\xc1")
    w.run_once()
    assert len(announced) == 2 and w.report().num_bad_notifications == 1
    w.close()
