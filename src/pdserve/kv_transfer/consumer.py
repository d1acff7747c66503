"""The consumer role of the scheduler-side connector (engine process of a decode instance).

Per producer engine id: one lazy handshake, cached, deduplicated while in flight, run on the side
channel's thread (off the step loop) with a timeout; the producer's TP size comes from the request, so
the handshake asks only for the producer ranks this instance's ranks read from. Per request: a
heartbeat on admission and every lease/3 (the READ is posted only before the conservative deadline
that the last acknowledged heartbeat gives), then one READ per rank, then a transition once every
rank has reported, or a failure when they have not within the READ timeout (the blocks are then
quarantined: a READ may still land). Whoever gives up tells the producer to release.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import OrderedDict

from pdserve.config import KVTransferConfig
from pdserve.engine.request import Request
from pdserve.kv_transfer.handshake import HandshakeError, Peer, PeerState, PeerTable
from pdserve.kv_transfer.load import WAITING, Load, LoadState
from pdserve.kv_transfer.messages import (ConnectorReport, Fingerprint, Heartbeat, HeartbeatAck,
                                          PeerAgents, ReadFailure, ReadSpec, Release)
from pdserve.kv_transfer.side_channel import SideChannelClient
from pdserve.sampling_params import InvalidRequestError

logger = logging.getLogger(__name__)

REPORT_GRACE_S = 5.0  # after the READ timeout, how long the ranks get to report before we stop waiting
MIN_HEARTBEAT_S = 0.05
CLAIMS_KEPT = 1 << 16


class ConsumerSide:
    def __init__(self, engine, config: KVTransferConfig, fingerprint: Fingerprint, tp_size: int):
        self.engine = engine
        self.config = config
        self.fingerprint = fingerprint
        self.tp_size = tp_size
        self.num_kv_heads = engine.spec.num_kv_heads
        self.client = SideChannelClient(config.secret)
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self.peers = PeerTable(self.client, fingerprint, tp_size, engine.spec.num_kv_heads,
                               config.handshake_timeout_s, self._event)
        self.loads: dict[str, Load] = {}
        self._claimed: OrderedDict[tuple[str, str], None] = OrderedDict()  # params already used
        self.counters = {"nixl_num_failed_transfers": 0, "kv_transfers": 0, "kv_heartbeats": 0}
        self.transfers: list[dict] = []

    # --- admission ------------------------------------------------------------------------------

    def claim(self, params) -> None:
        """At add_request: one producer request's KV is read by one consumer request, once. A second
        request with the same params (a retried decode leg) could otherwise read blocks the producer
        freed after the first read."""
        key = (params.remote_engine_id, params.remote_request_id)
        if key in self._claimed:
            raise InvalidRequestError("kv_transfer_params.remote_request_id",
                                      f"{params.remote_request_id!r} of producer "
                                      f"{params.remote_engine_id!r} was already used by another request")
        self._claimed[key] = None
        if len(self._claimed) > CLAIMS_KEPT:
            self._claimed.popitem(last=False)

    def start(self, request: Request) -> None:
        p = request.kv_transfer
        load = Load(request)
        self.loads[request.request_id] = load
        peer = self.peers.get(p.remote_engine_id)
        if peer is None:
            peer = self.peers.handshake(p.remote_engine_id, p.remote_host, p.remote_port, p.tp_size)
        elif peer.state == PeerState.READY and peer.tp_size != p.tp_size:
            self._fail(load, f"kv_transfer_params.tp_size={p.tp_size} but producer "
                             f"{p.remote_engine_id} has tp_size={peer.tp_size}")
            return
        self._heartbeat(peer, [load], time.monotonic())

    def _heartbeat(self, peer: Peer, loads: list[Load], now: float) -> None:
        for l in loads:
            l.last_heartbeat = now
        self.counters["kv_heartbeats"] += 1
        msg = Heartbeat(self.engine.engine_id, self.tp_size, [l.params.remote_request_id for l in loads])
        ids = [l.request.request_id for l in loads]
        self.client.send(peer.host, peer.port, msg, self.config.handshake_timeout_s,
                         lambda reply: self._event(("heartbeat", peer.engine_id, now, ids, reply)))

    def _event(self, event: tuple) -> None:
        """Side-channel thread: hand a reply to the engine thread and wake it."""
        self._events.put(event)
        self.engine.wake()

    def release(self, request: Request, reason: str) -> None:
        """Tell the producer to free this request's blocks (once; the producer ignores repeats)."""
        if request.kv_released:
            return
        request.kv_released = True
        p = request.kv_transfer
        self.client.send(p.remote_host, p.remote_port,
                         Release(self.engine.engine_id, [p.remote_request_id], reason),
                         self.config.handshake_timeout_s, lambda reply: None)

    # --- engine thread, every loop turn ----------------------------------------------------------

    def tick(self, now: float) -> None:
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
            if event[0] == "handshake":
                self._on_handshake(*event[1:])
            else:
                self._on_heartbeat(*event[1:])
        due: dict[str, list[Load]] = {}
        for load in list(self.loads.values()):
            if load.state in (LoadState.READING, LoadState.ABORTING) and now > load.reports_due:
                self._finish(load, stalled=True)
                continue
            if now - load.last_heartbeat >= self._period(load) and load.state != LoadState.ABORTING:
                due.setdefault(load.params.remote_engine_id, []).append(load)
        for engine_id, loads in due.items():
            peer = self.peers.get(engine_id)
            if peer is not None:
                self._heartbeat(peer, loads, now)

    def _on_handshake(self, engine_id: str, started: float, reply) -> None:
        peer = self.peers.get(engine_id)
        if peer is None or peer.state == PeerState.READY:
            return
        try:
            agents = self.peers.check(peer, reply)
        except HandshakeError as e:
            logger.warning("handshake with %s failed: %s", engine_id, e)
            self._evict_peer(engine_id, f"KV handshake with producer {engine_id} failed: {e}")
            return
        for load in [l for l in self.loads.values() if l.params.remote_engine_id == engine_id
                     and l.params.tp_size != agents.tp_size]:
            self._fail(load, f"kv_transfer_params.tp_size={load.params.tp_size} but producer "
                             f"{engine_id} has tp_size={agents.tp_size}")
        if agents.tp_size != peer.tp_size:  # the first request was wrong: ask for the right ranks
            if any(l.params.remote_engine_id == engine_id for l in self.loads.values()):
                self.peers.handshake(engine_id, peer.host, peer.port, agents.tp_size)
            else:
                self.peers.evict(engine_id)
            return
        for gone in self.peers.ready(peer, agents, started):
            self._evict_peer(gone, f"producer at {peer.host}:{peer.port} restarted as {engine_id}")
        self._promote(peer)

    def _on_heartbeat(self, engine_id: str, sent_at: float, request_ids: list[str], reply) -> None:
        if not isinstance(reply, HeartbeatAck):
            if any(rid in self.loads and self.loads[rid].state in WAITING for rid in request_ids):
                self._evict_peer(engine_id, f"producer {engine_id} unreachable (heartbeat: {reply})")
            return
        for rid, alive in zip(request_ids, reply.alive):
            load = self.loads.get(rid)
            if load is None:
                continue
            if not alive:
                if load.state in WAITING:
                    self._fail(load, f"producer {engine_id} no longer holds the KV of "
                                     f"{load.params.remote_request_id} (lease expired or released)")
                continue
            load.deadline = sent_at + reply.lease_s - max(0.1 * reply.lease_s, 0.05)
            load.lease_s = reply.lease_s
            load.quarantine_s = reply.quarantine_s
        peer = self.peers.get(engine_id)
        if peer is not None:
            self._promote(peer)

    def _promote(self, peer: Peer) -> None:
        if peer.state != PeerState.READY:
            return
        for load in self.loads.values():
            if load.state == LoadState.WAITING_PEER and load.deadline is not None \
                    and load.params.remote_engine_id == peer.engine_id:
                load.move_to(LoadState.READY)

    # --- step metadata and reports ----------------------------------------------------------------

    def build(self) -> tuple[list[PeerAgents], list[str], list[ReadSpec]]:
        peers = self.peers.to_workers()
        evict = self.peers.take_evicted()
        reads = []
        now = time.monotonic()
        for load in [l for l in self.loads.values() if l.state == LoadState.READY]:
            p = load.params
            peer = self.peers.get(p.remote_engine_id)
            if peer is None or peer.state != PeerState.READY:
                self._fail(load, f"producer {p.remote_engine_id} is no longer reachable")
                continue
            pool_size = min((r.num_blocks for r in peer.agents.ranks), default=0)
            too_big = [b for b in p.remote_block_ids if b >= pool_size]
            if too_big:
                self._fail(load, f"kv_transfer_params.remote_block_ids {too_big[:4]} are beyond the "
                                 f"producer's pool ({pool_size} blocks)")
                continue
            timeout = min(self.config.transfer_timeout_s, load.quarantine_s / 2)
            load.move_to(LoadState.READING)
            load.reports_due = now + timeout + REPORT_GRACE_S
            local = load.request.block_ids[:len(p.remote_block_ids)]
            reads.append(ReadSpec(load.request.request_id, p.remote_engine_id, p.remote_request_id,
                                  list(p.remote_block_ids), local, p.tp_size, load.deadline, timeout))
        return peers, evict, reads

    def process(self, reports: list[ConnectorReport]) -> None:
        for rank, report in enumerate(reports):
            for item in [*report.done, *report.failed]:
                load = self.loads.get(item.request_id)
                if load is not None and load.state in (LoadState.READING, LoadState.ABORTING):
                    load.results[rank] = item
        for load in [l for l in self.loads.values() if len(l.results) == self.tp_size]:
            self._finish(load)

    def _finish(self, load: Load, stalled: bool = False) -> None:
        """Every rank reported (or, `stalled`, some never did within the READ timeout)."""
        request = load.request
        del self.loads[request.request_id]
        failures = [r for r in load.results.values() if isinstance(r, ReadFailure)]
        if not failures and not stalled:
            done = list(load.results.values())
            self.counters["kv_transfers"] += 1
            self.transfers.append({"num_bytes": sum(d.num_bytes for d in done),
                                   "num_descriptors": sum(d.num_descriptors for d in done),
                                   "duration_s": max(d.duration_s for d in done)})
            request.kv_loaded = True
            if load.state == LoadState.ABORTING:
                self.engine.finish_aborted(request)
            else:
                self.engine.scheduler.remote_kv_loaded(request)
            return
        self.counters["nixl_num_failed_transfers"] += 1
        reasons = sorted({f.reason for f in failures}) or ["some ranks never reported their READ"]
        if any(f.peer_gone for f in failures) or stalled:
            self._evict_peer(load.params.remote_engine_id, "; ".join(reasons))
        if stalled or any(f.in_doubt for f in failures):  # a READ may still land in these blocks
            self.engine.pool.quarantine_blocks(request.block_ids,
                                               time.monotonic() + 2 * self.config.transfer_timeout_s)
            request.block_ids = []
        if load.state == LoadState.ABORTING:
            self.release(request, "client aborted")
            self.engine.finish_aborted(request)
            return
        self._fail(load, f"KV transfer from producer {load.params.remote_engine_id} failed: "
                         + "; ".join(reasons))

    def _fail(self, load: Load, message: str) -> None:
        """Policy `fail`: the client gets `message`; `recompute`: prefill here instead."""
        request = load.request
        self.loads.pop(request.request_id, None)
        self.release(request, message)
        if self.config.failure_policy == "recompute":
            logger.warning("%s: %s; recomputing the prompt locally", request.request_id, message)
            request.kv_load_failed = True
            self.engine.scheduler.remote_kv_failed_recompute(request)
        else:
            logger.warning("%s: %s", request.request_id, message)
            self.engine.fail_request(request, message)

    def _evict_peer(self, engine_id: str, reason: str) -> None:
        """Forget a producer (the next request naming it handshakes again). Its requests that have
        not started reading cannot progress: they fail (or recompute) with `reason`; the ranks drop
        its agents once their in-flight READs from it have ended."""
        self.peers.evict(engine_id)
        for load in [l for l in self.loads.values()
                     if l.params.remote_engine_id == engine_id and l.state in WAITING]:
            self._fail(load, reason)

    def abort(self, request: Request) -> bool:
        """True when the engine must wait (a READ into the request's blocks may be in flight)."""
        load = self.loads.get(request.request_id)
        if load is None:
            return False
        if load.state in (LoadState.READING, LoadState.ABORTING):
            if load.state == LoadState.READING:
                load.move_to(LoadState.ABORTING)
            return True
        del self.loads[request.request_id]
        self.release(request, "client aborted")
        return False

    def request_finished(self, request: Request) -> None:
        """A consumer request ended before its KV was ever loaded (aborted while queued, say)."""
        if not request.kv_loaded and request.request_id not in self.loads:
            self.release(request, f"request ended ({request.status.value}) before reading")

    # --- scheduling hints and counters ------------------------------------------------------------

    @property
    def has_ready(self) -> bool:
        return any(l.state == LoadState.READY for l in self.loads.values()) or not self._events.empty()

    @property
    def is_reading(self) -> bool:
        return any(l.state in (LoadState.READING, LoadState.ABORTING) for l in self.loads.values())

    def _period(self, load: Load) -> float:
        """Heartbeats every third of the lease the producer acknowledged (never faster than 20/s)."""
        return max(MIN_HEARTBEAT_S, (load.lease_s or self.config.lease_s) / 3)

    def next_heartbeat(self) -> float | None:
        return min((l.last_heartbeat + self._period(l) for l in self.loads.values()), default=None)

    def counter_values(self) -> dict:
        return {**self.counters, "nixl_handshakes": len(self.peers.engine_ids_seen),
                "nixl_handshake_round_trips": self.peers.round_trips,
                "nixl_handshake_failures": self.peers.failures}

    def close(self) -> None:
        self.client.close()
