"""The worker side of the KV connector: one per TP rank, with the one thread that calls its transport.

TP rank process. Registers the rank's cache once; per step takes the engine's metadata (peers to
load or drop, READs to post) and hands back what happened since (READs done or failed, notifications
received). The transport thread polls every 0.2 ms while its own READs are in flight, every 1 ms
while the engine holds leased blocks (a READ only progresses while its target calls into the
transport), and otherwise sleeps until the next step brings work: an idle rank costs no CPU. When
the next report gets its first item, `on_report` wakes the engine, which steps to collect it: the
engine does not step while it waits for a READ or a notification.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import socket
import threading
import time
from typing import Callable

import msgspec

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer.descriptors import RegionTable
from pdserve.kv_transfer.lanes import CopyLane
from pdserve.kv_transfer.messages import (ConnectorMetadata, ConnectorReport, Notification, RankAgent,
                                          ReadDone, ReadFailure, ReceivedNotification)
from pdserve.kv_transfer.reader import Reader
from pdserve.transport.base import AgentFactory

logger = logging.getLogger(__name__)

READ_POLL_S = 0.0002
LEASE_POLL_S = 0.001
_notification_decoder = msgspec.msgpack.Decoder(Notification)


@dataclasses.dataclass(frozen=True)
class RegisteredCache:
    """This rank's KV cache as the connector sees it (the worker builds it from its cache)."""

    address: int
    size_bytes: int
    device: str
    regions: RegionTable


class WorkerConnector:
    def __init__(self, config: KVTransferConfig, num_kv_heads: int, rank: int, tp_size: int,
                 cache: RegisteredCache, engine_id: str, make_agent: AgentFactory,
                 threaded: bool = True, clock: Callable[[], float] = time.monotonic,
                 on_report: Callable[[], None] = lambda: None):
        """`threaded=False`: no transport thread; the owner calls `run_once` (tests). `on_report`:
        called on the transport thread when the report waiting for the next step gets its first
        item (once until `report` takes it)."""
        self.rank = rank
        self._on_report = on_report
        self.agent = make_agent(f"{engine_id}/rank{rank}")
        self.agent.register(cache.address, cache.size_bytes, cache.device)
        r = cache.regions
        sc = r.scales
        self._rank_agent = RankAgent(rank, self.agent.name, self.agent.metadata(), list(r.region_addresses),
                                     r.num_blocks, r.num_kv_heads, r.block_bytes, r.head_bytes,
                                     socket.gethostname(), r.dtype, list(sc.region_addresses) if sc else [],
                                     sc.block_bytes if sc else 0, sc.head_bytes if sc else 0)
        self._wake = threading.Event()
        lanes = [CopyLane(make_agent(f"{engine_id}/rank{rank}/lane{i}"), cache.address, cache.size_bytes,
                          cache.device, threaded, clock) for i in range(1, config.copy_lanes)]
        self.reader = Reader(self.agent, lanes, r, rank, tp_size, num_kv_heads, clock, self._wake,
                             config.secret)
        self._inbox: queue.SimpleQueue[ConnectorMetadata | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._report = ConnectorReport()
        self._announced = False  # `on_report` was called for the report being filled
        self._polling = False  # the engine holds leased blocks: poll notifications
        self._closed = False
        self._consumer_engine_id = engine_id
        self._thread = None
        if threaded:
            self._thread = threading.Thread(target=self._run, name=f"pdserve-nixl-rank{rank}", daemon=True)
            self._thread.start()

    # --- the worker's step thread ---------------------------------------------------------------

    def rank_agent(self) -> RankAgent:
        return self._rank_agent

    def start_step(self, meta: ConnectorMetadata) -> None:
        self._inbox.put(meta)
        self._wake.set()

    def report(self) -> ConnectorReport:
        with self._lock:
            report, self._report = self._report, ConnectorReport()
            self._announced = False
        return report

    def loaded_peers(self) -> list[str]:
        return self.reader.loaded()

    def close(self) -> None:
        self._inbox.put(None)
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for lane in self.reader.lanes:
            lane.close()
        self.agent.close()

    # --- the transport thread -------------------------------------------------------------------

    def _run(self) -> None:
        while not self._closed:
            if self.reader.inflight:
                timeout = READ_POLL_S
            elif self._polling:
                timeout = LEASE_POLL_S
            else:
                timeout = None  # nothing live: sleep until the next step
            self._wake.wait(timeout)
            self._wake.clear()
            self.run_once()

    def run_once(self) -> None:
        """One turn: apply new metadata, progress READs, collect notifications."""
        while True:
            try:
                meta = self._inbox.get_nowait()
            except queue.Empty:
                break
            if meta is None:
                self._closed = True
                return
            try:
                self._apply(meta)
            except Exception:  # noqa: BLE001 - never lose the thread
                logger.exception("rank %d: bad connector metadata", self.rank)
        try:
            if self._thread is None:
                for lane in self.reader.lanes:
                    lane.run_once()
            if self.reader.inflight:
                self._add(self.reader.progress())
            if self.reader.inflight or self._polling:
                self._collect_notifications()
        except Exception:  # noqa: BLE001 - the thread that reports every READ must live
            logger.exception("rank %d: transport progress failed", self.rank)

    def _apply(self, meta: ConnectorMetadata) -> None:
        self._consumer_engine_id = meta.consumer_engine_id
        self._polling = meta.poll_notifications
        for peer in meta.load_peers:
            try:
                self.reader.load_peer(peer)
            except Exception as e:  # noqa: BLE001 - the reads that need it fail below, clearly
                logger.warning("rank %d: cannot load producer %s: %s", self.rank, peer.engine_id, e)
                continue
            warning = self._same_host_warning(peer)
            if warning:
                logger.warning("SLOW KV TRANSFERS: rank %d reads producer %s on this host without "
                               "shared memory: %s", self.rank, peer.engine_id, warning)
                self._to_report(warnings=[f"producer {peer.engine_id} (same host): {warning}"])
        self.reader.evict(meta.evict_peers)
        failed = []
        for spec in meta.reads:
            try:
                failure = self.reader.post(spec, self._consumer_engine_id)
            except Exception as e:  # noqa: BLE001 - one bad read never loses the others
                logger.exception("rank %d: READ for %s failed to start", self.rank, spec.request_id)
                failure = ReadFailure(spec.request_id, spec.engine_id, f"the READ could not be posted: {e}",
                                      False, False)
            if failure is not None:
                failed.append(failure)
        self._add(failed)

    def _same_host_warning(self, peer) -> str | None:
        here = socket.gethostname()
        if not any(ra.hostname == here for ra in peer.ranks):
            return None
        return self.agent.same_host_warning()

    def _add(self, results: list[ReadDone | ReadFailure]) -> None:
        """READ outcomes for the next report."""
        if results:
            self._to_report(done=[r for r in results if not isinstance(r, ReadFailure)],
                            failed=[r for r in results if isinstance(r, ReadFailure)])

    def _to_report(self, done=(), failed=(), notifications=(), num_bad_notifications=0, warnings=()) -> None:
        """Add to the next report; the first addition since the engine took one wakes it."""
        with self._lock:
            r = self._report
            r.done.extend(done)
            r.failed.extend(failed)
            r.notifications.extend(notifications)
            r.num_bad_notifications += num_bad_notifications
            r.warnings.extend(warnings)
            announce, self._announced = not self._announced, True
        if announce:
            self._on_report()

    def _collect_notifications(self) -> None:
        try:
            notes = self.agent.notifications()
        except Exception as e:  # noqa: BLE001
            logger.warning("rank %d: reading notifications failed: %s", self.rank, e)
            return
        received, bad = [], 0
        for sender, messages in notes.items():
            for raw in messages:
                try:
                    received.append(ReceivedNotification(self.rank, sender, _notification_decoder.decode(raw)))
                except msgspec.DecodeError:
                    bad += 1
                    logger.warning("rank %d: undecodable notification from %s", self.rank, sender)
        if received or bad:
            self._to_report(notifications=received, num_bad_notifications=bad)
