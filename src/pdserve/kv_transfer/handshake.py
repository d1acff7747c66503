"""The handshake, both halves (docs/design.md, "Handshake").

* Producer half, `answer_handshake`: side-channel thread of a producer. Replies with the agent
  metadata of exactly the ranks asked for, after checking version and engine id.
* Consumer half, `PeerTable`: engine thread of a consumer. One handshake per producer engine id,
  asking only for the producer ranks this instance's ranks read from (the producer's TP size comes
  from the request, never from a round trip). The reply is checked in order: transport error,
  version, producer-side error, fingerprint (before anything else is decoded; KV cache dtypes may
  differ only where the consumer converts, model/kv_dtype.py), engine id, TP size; only then is the
  payload decoded. What a failure means for the requests waiting on that producer
  is the consumer's business.

The producer's TP size is validated here and at the edge (params.py) only.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Callable

import msgspec

from pdserve.kv_transfer.messages import (HANDSHAKE_VERSION, ErrorReply, Fingerprint, HandshakePayload,
                                          HandshakeReply, HandshakeRequest, PeerAgents, RankAgent)
from pdserve.kv_transfer.topology import producer_ranks_for
from pdserve.model import kv_dtype


class HandshakeError(RuntimeError):
    pass


def ranks_to_ask(producer_tp_size: int, consumer_tp_size: int, num_kv_heads: int) -> list[int]:
    """The union of the producer ranks this instance's ranks read from (never more)."""
    return sorted({r for c in range(consumer_tp_size)
                   for r in producer_ranks_for(c, producer_tp_size, consumer_tp_size, num_kv_heads)})


# --- producer half --------------------------------------------------------------------------------

def answer_handshake(msg: HandshakeRequest, engine_id: str, fingerprint: Fingerprint,
                     rank_agents: list[RankAgent]) -> HandshakeReply:
    def refuse(error: str) -> HandshakeReply:
        return HandshakeReply(HANDSHAKE_VERSION, engine_id, fingerprint, error=error)
    if msg.version != HANDSHAKE_VERSION:
        return refuse(f"handshake version {msg.version} is not {HANDSHAKE_VERSION}")
    if msg.engine_id != engine_id:  # the consumer's params name an engine that is gone (a restart)
        return refuse(f"this is engine {engine_id}, not {msg.engine_id}")
    tp_size = len(rank_agents)
    bad = [r for r in msg.ranks if not 0 <= r < tp_size]
    if bad:
        return refuse(f"ranks {bad} do not exist (tp_size={tp_size})")
    payload = HandshakePayload(tp_size, [rank_agents[r] for r in sorted(set(msg.ranks))])
    return HandshakeReply(HANDSHAKE_VERSION, engine_id, fingerprint, payload=msgspec.msgpack.encode(payload))


# --- consumer half --------------------------------------------------------------------------------

class PeerState(enum.Enum):
    HANDSHAKING = "handshaking"
    READY = "ready"


@dataclasses.dataclass
class Peer:
    engine_id: str
    host: str
    port: int
    producer_tp_size: int  # what the requests said; the handshake reply confirms it
    asked: list[int]  # producer ranks asked for
    state: PeerState = PeerState.HANDSHAKING
    agents: PeerAgents | None = None
    sent_to_workers: bool = False


@dataclasses.dataclass(frozen=True)
class HandshakeReplied:
    """Side-channel thread -> engine thread: a handshake reply (or the transport's exception)."""

    engine_id: str
    started: float
    reply: object


@dataclasses.dataclass(frozen=True)
class HandshakeResult:
    """What a reply did to the peer table, for the consumer to apply to its requests."""

    engine_id: str
    ready: bool = False
    error: str | None = None  # the peer was evicted for this reason
    producer_tp_size: int | None = None  # the producer's, from a reply that passed every other check
    replaced: tuple[str, ...] = ()  # engine ids that were at its address before (a restart)


def accept_reply(reply, peer: Peer, ours: Fingerprint, timeout_s: float) -> PeerAgents:
    """The producer's agents for the ranks asked for; raises HandshakeError saying what is wrong.
    A reply whose TP size differs from the one asked with is returned as is (its agents are the
    wrong ones): the caller decides."""
    if isinstance(reply, BaseException):
        kind = "timed out" if isinstance(reply, TimeoutError) else "failed"
        raise HandshakeError(f"producer unreachable (handshake {kind} after {timeout_s:g} s: {reply})")
    if isinstance(reply, ErrorReply):
        raise HandshakeError(f"the producer refused the handshake: {reply.error}")
    if not isinstance(reply, HandshakeReply):
        raise HandshakeError(f"unexpected reply {type(reply).__name__}")
    if reply.version != HANDSHAKE_VERSION:
        raise HandshakeError(f"handshake version {reply.version}, expected {HANDSHAKE_VERSION}")
    if reply.error:
        raise HandshakeError(reply.error)
    if reply.fingerprint is None:
        raise HandshakeError("the reply carries no compatibility fingerprint")
    differences = ours.differences(reply.fingerprint, ignore=("kv_cache_dtype",))
    if differences:
        raise HandshakeError("incompatible producer: " + "; ".join(differences))
    if not kv_dtype.convertible(reply.fingerprint.kv_cache_dtype, ours.kv_cache_dtype):
        raise HandshakeError(kv_dtype.incompatible(reply.fingerprint.kv_cache_dtype, ours.kv_cache_dtype))
    if reply.engine_id != peer.engine_id:
        raise HandshakeError(f"reached engine {reply.engine_id}, expected {peer.engine_id}")
    try:
        payload = msgspec.msgpack.decode(reply.payload, type=HandshakePayload)
    except msgspec.DecodeError as e:
        raise HandshakeError(f"undecodable handshake payload: {e}") from None
    if payload.producer_tp_size < 1:
        raise HandshakeError(f"the reply's tp_size {payload.producer_tp_size} is not positive")
    got = sorted(r.rank for r in payload.ranks)
    if payload.producer_tp_size == peer.producer_tp_size and got != peer.asked:
        raise HandshakeError(f"the reply carries ranks {got}, not the ranks asked for {peer.asked}")
    return PeerAgents(peer.engine_id, payload.producer_tp_size, payload.ranks)


def tp_mismatch(engine_id: str, claimed: int, actual: int) -> str:
    return f"kv_transfer_params.tp_size={claimed} but producer {engine_id} has tp_size={actual}"


class PeerTable:
    def __init__(self, client, fingerprint: Fingerprint, consumer_tp_size: int, num_kv_heads: int,
                 timeout_s: float, on_reply: Callable[[HandshakeReplied], None],
                 clock: Callable[[], float] = time.monotonic):
        self.client = client
        self.fingerprint = fingerprint
        self.consumer_tp_size = consumer_tp_size
        self.num_kv_heads = num_kv_heads
        self.timeout_s = timeout_s
        self.deliver = on_reply  # called on the side channel's thread: hands the reply over
        self.clock = clock
        self.peers: dict[str, Peer] = {}
        self.evicted: list[str] = []  # for the ranks: drop these agents
        self.engine_ids_seen: set[str] = set()
        self.round_trips = 0
        self.failures = 0
        self.latencies: list[float] = []  # since the last `take_latencies`, bounded below

    def get(self, engine_id: str) -> Peer | None:
        return self.peers.get(engine_id)

    def check_tp(self, engine_id: str, producer_tp_size: int) -> str | None:
        """For a request naming a verified producer: why its TP size is wrong, or None."""
        peer = self.peers.get(engine_id)
        if peer is None or peer.state != PeerState.READY or peer.producer_tp_size == producer_tp_size:
            return None
        return tp_mismatch(engine_id, producer_tp_size, peer.producer_tp_size)

    def handshake(self, engine_id: str, host: str, port: int, producer_tp_size: int) -> Peer:
        """Start (or restart, with another TP size) the one handshake with this producer."""
        peer = Peer(engine_id, host, port, producer_tp_size,
                    ranks_to_ask(producer_tp_size, self.consumer_tp_size, self.num_kv_heads))
        self.peers[engine_id] = peer
        self.engine_ids_seen.add(engine_id)
        started = self.clock()
        self.client.send(host, port, HandshakeRequest(HANDSHAKE_VERSION, engine_id, peer.asked),
                         self.timeout_s,
                         lambda reply: self.deliver(HandshakeReplied(engine_id, started, reply)))
        return peer

    def accept(self, event: HandshakeReplied) -> HandshakeResult | None:
        """Apply one reply (engine thread). None when nobody waits for it any more."""
        peer = self.peers.get(event.engine_id)
        if peer is None or peer.state == PeerState.READY:
            return None
        self.round_trips += 1
        try:
            agents = accept_reply(event.reply, peer, self.fingerprint, self.timeout_s)
        except HandshakeError as e:
            self.failures += 1
            self.evict(event.engine_id)
            return HandshakeResult(event.engine_id, error=f"KV handshake with producer {event.engine_id} "
                                                          f"failed: {e}")
        if agents.producer_tp_size != peer.producer_tp_size:  # asked for the wrong ranks
            self.evict(event.engine_id)
            return HandshakeResult(event.engine_id, producer_tp_size=agents.producer_tp_size)
        peer.agents = agents
        peer.state = PeerState.READY
        self.latencies.append(self.clock() - event.started)
        del self.latencies[:-LATENCIES_KEPT]
        replaced = [p.engine_id for p in self.peers.values()
                    if (p.host, p.port) == (peer.host, peer.port) and p.engine_id != peer.engine_id]
        for engine_id in replaced:
            self.evict(engine_id)
        return HandshakeResult(event.engine_id, ready=True, producer_tp_size=agents.producer_tp_size,
                               replaced=tuple(replaced))

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

    def take_latencies(self) -> list[float]:
        latencies, self.latencies = self.latencies, []
        return latencies


LATENCIES_KEPT = 1024  # handshake latencies kept between two scrapes of /metrics
