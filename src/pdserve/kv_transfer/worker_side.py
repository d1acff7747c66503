"""The worker side of the KV connector: one per TP rank, with the one thread that makes NIXL calls.

TP rank process. Registers the rank's cache once; per step takes the engine's metadata (peers to
load, reads to post) and hands back what finished (reads done or failed, notifications received).
The NIXL thread polls every 0.2 ms while its own READs are in flight, every 1 ms while the engine
holds leased blocks (a READ only progresses while its target calls into NIXL), and otherwise sleeps
until the next step brings work: an idle rank costs no CPU.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time

import msgspec
import numpy as np

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer.descriptors import RegionTable, build_descriptors
from pdserve.kv_transfer.lanes import CopyLane, LanePart, lane_shares
from pdserve.kv_transfer.messages import (ConnectorMetadata, ConnectorReport, Notification,
                                          NotificationKind, PeerAgents, RankAgent, ReadDone,
                                          ReadFailure, ReadSpec, ReceivedNotification)
from pdserve.kv_transfer.topology import read_plan
from pdserve.model.spec import ModelSpec
from pdserve.transport.nixl_agent import NixlAgent, TransferError
from pdserve.worker.kv_cache import KVCache

logger = logging.getLogger(__name__)

READ_POLL_S = 0.0002
LEASE_POLL_S = 0.001
_notification_encoder = msgspec.msgpack.Encoder()
_notification_decoder = msgspec.msgpack.Decoder(Notification)


@dataclasses.dataclass
class _InFlight:
    spec: ReadSpec
    handles: list  # one READ per producer rank
    started: float
    num_bytes: int
    num_descriptors: int
    failed: str | None = None
    peer_gone: bool = False
    lane_parts: list[LanePart] = dataclasses.field(default_factory=list)
    notes: list[tuple[str, bytes]] = dataclasses.field(default_factory=list)  # sent once all parts land


class WorkerConnector:
    def __init__(self, config: KVTransferConfig, spec: ModelSpec, rank: int, tp_size: int,
                 kv_cache: KVCache, engine_id: str):
        self.config = config
        self.rank = rank
        self.tp_size = tp_size
        self.num_kv_heads = spec.num_kv_heads
        layout = kv_cache.layout
        self.local = RegionTable(tuple(kv_cache.region_addresses()), layout.block_bytes,
                                 layout.head_bytes, layout.num_kv_heads, layout.num_blocks)
        self.agent = NixlAgent(f"{engine_id}/rank{rank}", config.backend)
        self.agent.register(kv_cache.base_address, layout.total_bytes, str(kv_cache.buffer.device))
        self._rank_agent = RankAgent(rank, self.agent.name, self.agent.metadata(),
                                     list(self.local.region_addresses), layout.num_blocks,
                                     layout.num_kv_heads, layout.block_bytes, layout.head_bytes)
        self._lanes = [CopyLane(f"{engine_id}/rank{rank}/lane{i}", config.backend,
                                kv_cache.base_address, layout.total_bytes, str(kv_cache.buffer.device))
                       for i in range(1, config.copy_lanes)]
        self._inbox: queue.SimpleQueue[ConnectorMetadata | None] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._report = ConnectorReport()
        # NIXL-thread state
        self._peers: dict[str, tuple[int, dict[int, tuple[str, RegionTable]]]] = {}
        self._evicting: set[str] = set()  # dropped by the engine; agents go once their READs end
        self._inflight: list[_InFlight] = []
        self._polling = False
        self._consumer_engine_id = engine_id
        self._thread = threading.Thread(target=self._run, name=f"pdserve-nixl-rank{rank}", daemon=True)
        self._thread.start()

    # --- worker thread --------------------------------------------------------------------------

    def rank_agent(self) -> RankAgent:
        return self._rank_agent

    def start_step(self, meta: ConnectorMetadata) -> None:
        self._inbox.put(meta)
        self._wake.set()

    def report(self) -> ConnectorReport:
        with self._lock:
            report, self._report = self._report, ConnectorReport()
        return report

    def loaded_peers(self) -> list[str]:
        return sorted(f"{e}/rank{r}" for e, (_, ranks) in list(self._peers.items()) for r in ranks)

    def close(self) -> None:
        self._inbox.put(None)
        self._wake.set()
        self._thread.join(timeout=5)
        for lane in self._lanes:
            lane.close()
        self.agent.close()

    # --- the NIXL thread --------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            if self._inflight:
                timeout = READ_POLL_S
            elif self._polling:
                timeout = LEASE_POLL_S
            else:
                timeout = None  # nothing live: sleep until the next step
            self._wake.wait(timeout)
            self._wake.clear()
            while True:
                try:
                    meta = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if meta is None:
                    return
                try:
                    self._apply(meta)
                except Exception:  # noqa: BLE001 - never lose the thread
                    logger.exception("rank %d: bad connector metadata", self.rank)
            try:
                if self._inflight:
                    self._progress()
                if self._inflight or self._polling:
                    self._collect_notifications()
            except Exception:  # noqa: BLE001 - the thread that reports every READ must live
                logger.exception("rank %d: NIXL progress failed", self.rank)

    def _apply(self, meta: ConnectorMetadata) -> None:
        self._consumer_engine_id = meta.consumer_engine_id
        self._polling = meta.poll_notifications
        self._evicting.update(e for e in meta.evict_peers if e in self._peers)
        for peer in meta.load_peers:
            try:
                self._load_peer(peer)
            except Exception as e:  # noqa: BLE001 - the reads that need it fail below, clearly
                logger.warning("rank %d: cannot load producer %s: %s", self.rank, peer.engine_id, e)
        for spec in meta.reads:
            try:
                self._post(spec)
            except Exception as e:  # noqa: BLE001 - one bad read never loses the others
                logger.exception("rank %d: READ for %s failed to start", self.rank, spec.request_id)
                self._fail(spec, f"the READ could not be posted: {e}")
        self._drop_evicted()

    def _load_peer(self, peer: PeerAgents) -> None:
        if peer.engine_id in self._peers:  # handshaken again before its eviction completed
            self._evicting.discard(peer.engine_id)
            return
        needed = {s.producer_rank for s in read_plan(peer.tp_size, self.tp_size, self.num_kv_heads)[self.rank]}
        ranks = {}
        for ra in peer.ranks:
            if ra.rank not in needed:
                continue  # another of our ranks reads from it
            name = self.agent.add_peer(ra.agent_metadata)
            for lane in self._lanes:
                lane.add_peer(ra.agent_metadata)
            ranks[ra.rank] = (name, RegionTable(tuple(ra.region_addresses), ra.block_bytes,
                                                ra.head_bytes, ra.num_kv_heads, ra.num_blocks))
        self._peers[peer.engine_id] = (peer.tp_size, ranks)

    def _drop_evicted(self) -> None:
        """Remove the agents of evicted producers that no in-flight READ still uses."""
        busy = {r.spec.engine_id for r in self._inflight}
        for engine_id in [e for e in self._evicting if e not in busy]:
            self._evicting.discard(engine_id)
            _, ranks = self._peers.pop(engine_id, (0, {}))
            for name, _ in ranks.values():
                self.agent.remove_peer(name)
                for lane in self._lanes:
                    lane.remove_peer(name)

    def _post(self, spec: ReadSpec) -> None:
        now = time.monotonic()
        if now > spec.deadline:
            return self._fail(spec, "the producer's lease would end before the READ (deadline passed)")
        entry = self._peers.get(spec.engine_id)
        if entry is None or spec.engine_id in self._evicting:
            return self._fail(spec, f"producer {spec.engine_id} is not loaded on rank {self.rank}",
                              peer_gone=True)
        _, ranks = entry
        by_rank: dict[int, list] = {}
        for s in read_plan(spec.remote_tp_size, self.tp_size, self.num_kv_heads)[self.rank]:
            if s.producer_rank not in ranks:
                return self._fail(spec, f"producer rank {s.producer_rank} of {spec.engine_id} is "
                                        f"not loaded on rank {self.rank}", peer_gone=True)
            name, remote = ranks[s.producer_rank]
            by_rank.setdefault(s.producer_rank, []).append(build_descriptors(
                self.local, remote, s, spec.local_block_ids, spec.remote_block_ids))
        read = _InFlight(spec, [], now, 0, 0)
        for p_rank, parts in by_rank.items():
            local = np.concatenate([l for l, _ in parts])
            remote = np.concatenate([r for _, r in parts])
            peer = ranks[p_rank][0]
            note = _notification_encoder.encode(Notification(
                spec.remote_request_id, self._consumer_engine_id, self.rank, self.tp_size,
                NotificationKind.DONE))
            read.num_bytes += int(local[:, 1].sum())
            read.num_descriptors += len(local)
            shares = lane_shares(local[:, 1], 1 + len(self._lanes))
            if len(shares) > 1:  # lanes copy the other shares; the producer hears once all land
                for lane, (lo, hi) in zip(self._lanes, shares[1:]):
                    read.lane_parts.append(lane.read(peer, local[lo:hi], remote[lo:hi],
                                                     now + spec.timeout_s, self._wake))
                lo, hi = shares[0]
                local, remote = local[lo:hi], remote[lo:hi]
                read.notes.append((peer, note))
                note = b""
            try:
                handle = self.agent.read(peer, local, remote, note)
            except Exception as e:  # noqa: BLE001 - READs already posted stay tracked until they end
                read.failed, read.peer_gone = str(e), isinstance(e, TransferError)
                break
            read.handles.append(handle)
        self._inflight.append(read)
        self._progress()

    def _progress(self) -> None:
        now = time.monotonic()
        still = []
        for read in self._inflight:
            states = [self.agent.state(h) for h in read.handles]
            if "ERR" in states and read.failed is None:
                read.failed, read.peer_gone = "the producer went away or the READ failed", True
            for part in read.lane_parts:
                if part.done.is_set() and part.error and read.failed is None:
                    read.failed, read.peer_gone = part.error, part.peer_gone
            busy = "PROC" in states or not all(p.done.is_set() for p in read.lane_parts)
            timed_out = now - read.started > read.spec.timeout_s
            if busy and not timed_out:
                still.append(read)
                continue
            for h in read.handles:
                self.agent.release(h)
            if timed_out and busy:
                self._fail(read.spec, f"READ timed out after {read.spec.timeout_s:g} s",
                           peer_gone=True, in_doubt=True)
            elif read.failed:
                self._fail(read.spec, read.failed, peer_gone=read.peer_gone)
            elif not self._notify(read):
                self._fail(read.spec, "the READ landed but the producer could not be told",
                           peer_gone=True, in_doubt=True)
            else:
                with self._lock:
                    self._report.done.append(ReadDone(read.spec.request_id, read.num_bytes,
                                                      read.num_descriptors, now - read.started))
        self._inflight = still
        if self._evicting:
            self._drop_evicted()

    def _notify(self, read: _InFlight) -> bool:
        """Tell the producer(s) a READ split across lanes has fully landed."""
        try:
            for peer, note in read.notes:
                self.agent.notify(peer, note)
        except Exception as e:  # noqa: BLE001 - reported as a failed READ
            logger.warning("rank %d: DONE notification for %s failed: %s", self.rank,
                           read.spec.request_id, e)
            return False
        return True

    def _fail(self, spec: ReadSpec, reason: str, peer_gone: bool = False, in_doubt: bool = False) -> None:
        with self._lock:
            self._report.failed.append(ReadFailure(spec.request_id, spec.engine_id, reason,
                                                   peer_gone, in_doubt))

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
                    received.append(ReceivedNotification(self.rank, _notification_decoder.decode(raw)))
                except msgspec.DecodeError:
                    bad += 1
                    logger.warning("rank %d: undecodable notification from %s", self.rank, sender)
        if received or bad:
            with self._lock:
                self._report.notifications.extend(received)
                self._report.num_bad_notifications += bad
