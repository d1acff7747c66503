"""The producers a consumer has reached (or is reaching), and the checks a handshake reply passes.

Engine process of a consumer, engine thread (replies arrive through the side channel's thread and
are handed over). One handshake per producer engine id, asking only for the ranks this instance's
ranks read from. The reply is checked in order: transport error, version, producer-side error,
fingerprint (before anything else is decoded), engine id; only then is the payload decoded. Any
failure is a `HandshakeError` whose message says what differs; what it means for the requests
waiting on that producer is the consumer's business.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Callable

import msgspec

from pdserve.kv_transfer.messages import (HANDSHAKE_VERSION, Fingerprint, HandshakePayload,
                                          HandshakeReply, HandshakeRequest, PeerAgents)
from pdserve.kv_transfer.topology import producer_ranks_for


class HandshakeError(RuntimeError):
    pass


class PeerState(enum.Enum):
    HANDSHAKING = "handshaking"
    READY = "ready"


@dataclasses.dataclass
class Peer:
    engine_id: str
    host: str
    port: int
    tp_size: int  # as the first request claimed it, until the handshake says
    state: PeerState = PeerState.HANDSHAKING
    agents: PeerAgents | None = None
    sent_to_workers: bool = False
    asked: list[int] = dataclasses.field(default_factory=list)


def ranks_to_ask(producer_tp: int, consumer_tp: int, num_kv_heads: int) -> list[int]:
    """The union of the producer ranks this instance's ranks read from (never more)."""
    return sorted({r for c in range(consumer_tp)
                   for r in producer_ranks_for(c, producer_tp, consumer_tp, num_kv_heads)})


def accept_reply(reply, peer: Peer, ours: Fingerprint, timeout_s: float, asked: list[int]) -> PeerAgents:
    """The producer's agents. Their TP size may differ from the one the request claimed: the
    caller decides what that means for each waiting request."""
    if isinstance(reply, BaseException):
        kind = "timed out" if isinstance(reply, TimeoutError) else "failed"
        raise HandshakeError(f"producer unreachable (handshake {kind} after {timeout_s:g} s: {reply})")
    if not isinstance(reply, HandshakeReply):
        raise HandshakeError(f"unexpected reply {type(reply).__name__}")
    if reply.version != HANDSHAKE_VERSION:
        raise HandshakeError(f"handshake version {reply.version}, expected {HANDSHAKE_VERSION}")
    if reply.error:
        raise HandshakeError(reply.error)
    if reply.fingerprint is None:
        raise HandshakeError("the reply carries no compatibility fingerprint")
    if reply.fingerprint != ours:
        raise HandshakeError("incompatible producer: " + "; ".join(ours.differences(reply.fingerprint)))
    if reply.engine_id != peer.engine_id:
        raise HandshakeError(f"reached engine {reply.engine_id}, expected {peer.engine_id}")
    try:
        payload = msgspec.msgpack.decode(reply.payload, type=HandshakePayload)
    except msgspec.DecodeError as e:
        raise HandshakeError(f"undecodable handshake payload: {e}") from None
    if payload.tp_size == peer.tp_size and sorted(r.rank for r in payload.ranks) != asked:
        raise HandshakeError(f"the reply carries ranks {sorted(r.rank for r in payload.ranks)}, "
                             f"not the ranks asked for {asked}")
    return PeerAgents(peer.engine_id, payload.tp_size, payload.ranks)


class PeerTable:
    def __init__(self, client, fingerprint: Fingerprint, consumer_tp: int, num_kv_heads: int,
                 timeout_s: float, on_reply: Callable[[tuple], None]):
        self.client = client
        self.fingerprint = fingerprint
        self.consumer_tp = consumer_tp
        self.num_kv_heads = num_kv_heads
        self.timeout_s = timeout_s
        self.on_reply = on_reply  # side-channel thread -> engine thread
        self.peers: dict[str, Peer] = {}
        self.evicted: list[str] = []  # for the ranks: drop these agents
        self.engine_ids_seen: set[str] = set()
        self.round_trips = 0
        self.failures = 0
        self.latencies: list[float] = []

    def get(self, engine_id: str) -> Peer | None:
        return self.peers.get(engine_id)

    def handshake(self, engine_id: str, host: str, port: int, producer_tp: int) -> Peer:
        """Start (or restart, with another TP size) the one handshake with this producer."""
        peer = self.peers.get(engine_id) or Peer(engine_id, host, port, producer_tp)
        peer.tp_size = producer_tp
        peer.asked = ranks_to_ask(producer_tp, self.consumer_tp, self.num_kv_heads)
        self.peers[engine_id] = peer
        self.engine_ids_seen.add(engine_id)
        started = time.monotonic()
        self.client.send(host, port, HandshakeRequest(HANDSHAKE_VERSION, engine_id, peer.asked),
                         self.timeout_s, lambda reply: self.on_reply(("handshake", engine_id, started, reply)))
        return peer

    def check(self, peer: Peer, reply) -> PeerAgents:
        """Count the round trip and check the reply (raises HandshakeError)."""
        self.round_trips += 1
        try:
            return accept_reply(reply, peer, self.fingerprint, self.timeout_s, peer.asked)
        except HandshakeError:
            self.failures += 1
            raise

    def ready(self, peer: Peer, agents: PeerAgents, started: float) -> list[str]:
        """The producer is verified. Returns the engine ids that were at its address before (a
        restart): they are gone."""
        peer.agents = agents
        peer.state = PeerState.READY
        self.latencies.append(time.monotonic() - started)
        return [p.engine_id for p in self.peers.values()
                if (p.host, p.port) == (peer.host, peer.port) and p.engine_id != peer.engine_id]

    def evict(self, engine_id: str) -> None:
        peer = self.peers.pop(engine_id, None)
        if peer is not None and peer.sent_to_workers:
            self.evicted.append(engine_id)

    def to_workers(self) -> list[PeerAgents]:
        """Verified producers the ranks have not loaded yet (each rank loads only what it reads)."""
        out = []
        for peer in self.peers.values():
            if peer.state == PeerState.READY and not peer.sent_to_workers:
                peer.sent_to_workers = True
                out.append(peer.agents)
        return out

    def take_evicted(self) -> list[str]:
        evicted, self.evicted = self.evicted, []
        return evicted
