"""The consumer role of the scheduler-side connector (engine process of a decode instance).

Per producer engine id: one lazy handshake, cached, deduplicated while in flight, run on the side
channel's thread (off the step loop) with a timeout; the producer's TP size comes from the request, so
the handshake asks only for the producer ranks this instance's ranks read from. Per request: a
heartbeat on admission and every lease/3 (the READ is posted only before the conservative deadline
that the last acknowledged heartbeat gives), then one READ per rank, then a transition once every
rank has reported. Whoever gives up (client abort, failure) tells the producer to release.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import queue
import time

import msgspec

from pdserve.config import KVTransferConfig
from pdserve.engine.request import Request
from pdserve.kv_transfer.messages import (HANDSHAKE_VERSION, ConnectorReport, Fingerprint,
                                          HandshakePayload, HandshakeReply, HandshakeRequest,
                                          Heartbeat, HeartbeatAck, PeerAgents, ReadDone, ReadFailure,
                                          ReadSpec, Release)
from pdserve.kv_transfer.side_channel import SideChannelClient
from pdserve.kv_transfer.topology import producer_ranks_for

logger = logging.getLogger(__name__)


class PeerState(enum.Enum):
    HANDSHAKING = "handshaking"
    READY = "ready"


@dataclasses.dataclass
class Peer:
    engine_id: str
    host: str
    port: int
    tp_size: int
    state: PeerState = PeerState.HANDSHAKING
    agents: PeerAgents | None = None
    sent_to_workers: bool = False


class LoadState(enum.Enum):
    WAITING_PEER = "waiting_peer"  # handshake or first heartbeat acknowledgement outstanding
    READY = "ready"  # next step sends the READ
    READING = "reading"  # waiting for every rank's report
    ABORTING = "aborting"  # the client left while reading: end once every rank has reported


_TRANSITIONS = {
    LoadState.WAITING_PEER: {LoadState.READY},
    LoadState.READY: {LoadState.READING},
    LoadState.READING: {LoadState.ABORTING},
}


@dataclasses.dataclass
class Load:
    request: Request
    state: LoadState = LoadState.WAITING_PEER
    deadline: float | None = None  # monotonic; no READ may be posted after it
    last_heartbeat: float = 0.0
    results: dict[int, ReadDone | ReadFailure] = dataclasses.field(default_factory=dict)

    @property
    def params(self):
        return self.request.kv_transfer

    def move_to(self, state: LoadState) -> None:
        assert state in _TRANSITIONS.get(self.state, ()), f"{self.request.request_id}: {self.state} -> {state}"
        self.state = state


class ConsumerSide:
    def __init__(self, engine, config: KVTransferConfig, fingerprint: Fingerprint, tp_size: int):
        self.engine = engine
        self.config = config
        self.fingerprint = fingerprint
        self.tp_size = tp_size
        self.num_kv_heads = engine.spec.num_kv_heads
        self.client = SideChannelClient(config.secret)
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self.peers: dict[str, Peer] = {}
        self.loads: dict[str, Load] = {}
        self._evict: list[str] = []
        self.counters = {"nixl_handshakes": 0, "nixl_handshake_round_trips": 0,
                         "nixl_handshake_failures": 0, "nixl_num_failed_transfers": 0,
                         "kv_transfers": 0, "kv_heartbeats": 0}
        self.transfers: list[dict] = []
        self.handshake_latencies: list[float] = []

    # --- admission ------------------------------------------------------------------------------

    def start(self, request: Request) -> None:
        p = request.kv_transfer
        load = Load(request)
        self.loads[request.request_id] = load
        peer = self.peers.get(p.remote_engine_id)
        if peer is None:
            peer = self._handshake(p.remote_engine_id, p.remote_host, p.remote_port, p.tp_size)
        elif peer.tp_size != p.tp_size:
            self._fail(load, f"kv_transfer_params.tp_size={p.tp_size} differs from producer "
                             f"{p.remote_engine_id}'s handshake (tp_size={peer.tp_size})")
            return
        self._heartbeat(peer, [load], time.monotonic())

    def _handshake(self, engine_id: str, host: str, port: int, producer_tp: int) -> Peer:
        for other in [p for p in self.peers.values() if (p.host, p.port) == (host, port)]:
            logger.info("producer at %s:%d is now %s; dropping %s", host, port, engine_id, other.engine_id)
            self._evict_peer(other.engine_id)
        peer = Peer(engine_id, host, port, producer_tp)
        self.peers[engine_id] = peer
        ranks = sorted({r for c in range(self.tp_size)
                        for r in producer_ranks_for(c, producer_tp, self.tp_size, self.num_kv_heads)})
        self.counters["nixl_handshakes"] += 1
        started = time.monotonic()
        self.client.send(host, port, HandshakeRequest(HANDSHAKE_VERSION, engine_id, ranks),
                         self.config.handshake_timeout_s,
                         lambda reply: self._event(("handshake", engine_id, started, reply)))
        return peer

    def _heartbeat(self, peer: Peer, loads: list[Load], now: float) -> None:
        ids = [l.params.remote_request_id for l in loads]
        for l in loads:
            l.last_heartbeat = now
        self.counters["kv_heartbeats"] += 1
        msg = Heartbeat(self.engine.engine_id, self.tp_size, ids)
        self.client.send(peer.host, peer.port, msg, self.config.handshake_timeout_s,
                         lambda reply: self._event(("heartbeat", peer.engine_id, now,
                                                    [l.request.request_id for l in loads], reply)))

    def _event(self, event: tuple) -> None:
        """Side-channel thread: hand a reply to the engine thread and wake it."""
        self._events.put(event)
        self.engine.wake()

    def _release(self, load: Load, reason: str) -> None:
        p = load.params
        msg = Release(self.engine.engine_id, [p.remote_request_id], reason)
        self.client.send(p.remote_host, p.remote_port, msg, self.config.handshake_timeout_s,
                         lambda reply: None)

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
        for load in self.loads.values():
            period = (load.params.lease_s or self.config.lease_s) / 3
            if now - load.last_heartbeat >= period and load.state != LoadState.ABORTING:
                due.setdefault(load.params.remote_engine_id, []).append(load)
        for engine_id, loads in due.items():
            peer = self.peers.get(engine_id)
            if peer is not None:
                self._heartbeat(peer, loads, now)

    def _on_handshake(self, engine_id: str, started: float, reply) -> None:
        self.counters["nixl_handshake_round_trips"] += 1
        peer = self.peers.get(engine_id)
        if peer is None:
            return
        error = self._check_handshake(engine_id, reply)
        if error is None:
            payload = msgspec.msgpack.decode(reply.payload, type=HandshakePayload)
            if payload.tp_size != peer.tp_size:
                error = (f"producer {engine_id} has tp_size={payload.tp_size}, the request said "
                         f"{peer.tp_size}")
            else:
                peer.agents = PeerAgents(engine_id, payload.tp_size, payload.ranks)
                peer.state = PeerState.READY
                self.handshake_latencies.append(time.monotonic() - started)
                self._promote(peer)
                return
        self.counters["nixl_handshake_failures"] += 1
        logger.warning("handshake with %s failed: %s", engine_id, error)
        del self.peers[engine_id]
        for load in [l for l in self.loads.values() if l.params.remote_engine_id == engine_id]:
            self._fail(load, f"KV handshake with producer {engine_id} failed: {error}")

    def _check_handshake(self, engine_id: str, reply) -> str | None:
        """Version and fingerprint first; the payload is decoded only if they agree."""
        if isinstance(reply, BaseException):
            kind = "timed out" if isinstance(reply, TimeoutError) else "failed"
            return f"producer unreachable (handshake {kind} after {self.config.handshake_timeout_s:g} s: {reply})"
        if not isinstance(reply, HandshakeReply):
            return f"unexpected reply {type(reply).__name__}"
        if reply.version != HANDSHAKE_VERSION:
            return f"handshake version {reply.version}, expected {HANDSHAKE_VERSION}"
        if reply.error:
            return reply.error
        if reply.fingerprint != self.fingerprint:
            diff = "; ".join(self.fingerprint.differences(reply.fingerprint))
            return f"incompatible producer: {diff}"
        if reply.engine_id != engine_id:
            return f"reached engine {reply.engine_id}, expected {engine_id}"
        return None

    def _on_heartbeat(self, engine_id: str, sent_at: float, request_ids: list[str], reply) -> None:
        if isinstance(reply, BaseException) or not isinstance(reply, HeartbeatAck):
            for rid in request_ids:
                load = self.loads.get(rid)
                if load is not None and load.state in (LoadState.WAITING_PEER, LoadState.READY):
                    self._evict_peer(engine_id)
                    self._fail(load, f"producer {engine_id} unreachable (heartbeat: {reply})")
            return
        for rid, alive in zip(request_ids, reply.alive):
            load = self.loads.get(rid)
            if load is None:
                continue
            if not alive:
                if load.state in (LoadState.WAITING_PEER, LoadState.READY):
                    self._fail(load, f"producer {engine_id} no longer holds the KV of "
                                     f"{load.params.remote_request_id} (lease expired or released)")
                continue
            lease = reply.lease_s
            load.deadline = sent_at + lease - max(0.1 * lease, 0.05)
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
        peers = []
        for peer in self.peers.values():
            if peer.state == PeerState.READY and not peer.sent_to_workers:
                peer.sent_to_workers = True
                peers.append(peer.agents)
        evict, self._evict = self._evict, []
        reads = []
        for load in list(self.loads.values()):
            if load.state != LoadState.READY:
                continue
            p = load.params
            peer = self.peers[p.remote_engine_id]
            too_big = [b for b in p.remote_block_ids if b >= min(r.num_blocks for r in peer.agents.ranks)]
            if too_big:
                self._fail(load, f"kv_transfer_params.remote_block_ids {too_big[:4]} are beyond the "
                                 f"producer's pool ({peer.agents.ranks[0].num_blocks} blocks)")
                continue
            load.move_to(LoadState.READING)
            reads.append(ReadSpec(load.request.request_id, p.remote_engine_id, p.remote_request_id,
                                  list(p.remote_block_ids), list(load.request.block_ids),
                                  p.tp_size, load.deadline))
        return peers, evict, reads

    def process(self, reports: list[ConnectorReport]) -> None:
        for rank, report in enumerate(reports):
            for item in [*report.done, *report.failed]:
                load = self.loads.get(item.request_id)
                if load is not None and load.state in (LoadState.READING, LoadState.ABORTING):
                    load.results[rank] = item
        for load in [l for l in self.loads.values() if len(l.results) == self.tp_size]:
            self._finish(load)

    def _finish(self, load: Load) -> None:
        failures = [r for r in load.results.values() if isinstance(r, ReadFailure)]
        request = load.request
        if not failures:
            done = list(load.results.values())
            self.counters["kv_transfers"] += 1
            self.transfers.append({"num_bytes": sum(d.num_bytes for d in done),
                                   "num_descriptors": sum(d.num_descriptors for d in done),
                                   "duration_s": max(d.duration_s for d in done)})
            del self.loads[request.request_id]
            if load.state == LoadState.ABORTING:
                self.engine.finish_aborted(request)
            else:
                self.engine.scheduler.remote_kv_loaded(request)
            return
        self.counters["nixl_num_failed_transfers"] += 1
        if any(f.peer_gone for f in failures):
            self._evict_peer(load.params.remote_engine_id)
        if any(f.in_doubt for f in failures):  # a READ may still land in these blocks
            self.engine.pool.quarantine_blocks(request.block_ids,
                                               time.monotonic() + 2 * self.config.transfer_timeout_s)
            request.block_ids = []
        if load.state == LoadState.ABORTING:
            del self.loads[request.request_id]
            self._release(load, "client aborted")
            self.engine.finish_aborted(request)
            return
        self._fail(load, f"KV transfer from producer {load.params.remote_engine_id} failed: "
                         + "; ".join(sorted({f.reason for f in failures})))

    def _fail(self, load: Load, message: str) -> None:
        """Policy `fail`: the client gets `message`; `recompute`: prefill here instead."""
        request = load.request
        self.loads.pop(request.request_id, None)
        self._release(load, message)
        if self.config.failure_policy == "recompute":
            logger.warning("%s: %s; recomputing the prompt locally", request.request_id, message)
            request.kv_load_failed = True
            self.engine.scheduler.remote_kv_failed_recompute(request)
        else:
            logger.warning("%s: %s", request.request_id, message)
            self.engine.fail_request(request, message)

    def _evict_peer(self, engine_id: str) -> None:
        peer = self.peers.pop(engine_id, None)
        if peer is not None and peer.sent_to_workers:
            self._evict.append(engine_id)

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
        self._release(load, "client aborted")
        return False

    # --- scheduling hints -----------------------------------------------------------------------

    @property
    def has_ready(self) -> bool:
        return any(l.state == LoadState.READY for l in self.loads.values()) or not self._events.empty()

    @property
    def is_reading(self) -> bool:
        return any(l.state in (LoadState.READING, LoadState.ABORTING) for l in self.loads.values())

    def next_heartbeat(self) -> float | None:
        return min(((l.last_heartbeat + (l.params.lease_s or self.config.lease_s) / 3)
                    for l in self.loads.values()), default=None)

    def close(self) -> None:
        self.client.close()
