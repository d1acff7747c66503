"""The consumer's view of one producer engine, and the checks its handshake reply must pass.

Engine process of a consumer (called on the engine thread). The reply is checked in order:
transport error, version, producer-side error, fingerprint (before anything else is decoded),
engine id; only then is the payload decoded. Any failure is a `HandshakeError` whose message says
what differs, so it can end the waiting requests without touching the engine.
"""

from __future__ import annotations

import dataclasses
import enum

import msgspec

from pdserve.kv_transfer.messages import (HANDSHAKE_VERSION, Fingerprint, HandshakePayload,
                                          HandshakeReply, PeerAgents)
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
