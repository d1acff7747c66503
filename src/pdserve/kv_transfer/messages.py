"""Typed messages of the KV transfer connector, by boundary.

* engine -> TP rank, once per step: `ConnectorMetadata`; TP rank -> engine: `ConnectorReport`
* TP rank -> engine, once at start: `RankAgent` (what a peer needs to read this rank's cache)
* consumer rank -> producer rank, over NIXL notifications: `Notification`
* consumer engine <-> producer engine, over the ZMQ side channel: `Handshake*`, `Heartbeat*`, `Release`
"""

from __future__ import annotations

import enum

import msgspec

HANDSHAKE_VERSION = 1


# --- once per process: what each rank registered ---------------------------------------------

class RankAgent(msgspec.Struct, frozen=True):
    rank: int
    agent_name: str
    agent_metadata: bytes  # nixl get_agent_metadata()
    region_addresses: list[int]  # layer 0 K, layer 0 V, layer 1 K, ...
    num_blocks: int
    num_kv_heads: int  # heads held by this rank
    block_bytes: int
    head_bytes: int


class Fingerprint(msgspec.Struct, frozen=True):
    """Everything two engines must agree on before one reads the other's cache."""

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    layout: str = "HND"

    def differences(self, other: "Fingerprint") -> list[str]:
        return [f"{f}: ours={getattr(self, f)!r} theirs={getattr(other, f)!r}"
                for f in self.__struct_fields__ if getattr(self, f) != getattr(other, f)]


# --- engine -> rank, per step ----------------------------------------------------------------

class PeerAgents(msgspec.Struct, frozen=True):
    """A producer engine reached by a handshake; each rank loads only the agents it reads from."""

    engine_id: str
    producer_tp_size: int
    ranks: list[RankAgent]


class ReadSpec(msgspec.Struct, frozen=True):
    """One request's READ; each rank reads its heads from the producer ranks the plan names (the
    producer's TP size is the loaded peer's, from the handshake)."""

    request_id: str  # consumer's
    engine_id: str  # producer's
    remote_request_id: str
    remote_block_ids: list[int]
    local_block_ids: list[int]
    deadline: float  # time.monotonic(): never post the READ after this (the producer's lease)
    timeout_s: float  # abandon the READ after this long (below the producer's quarantine)


class ConnectorMetadata(msgspec.Struct):
    consumer_engine_id: str
    load_peers: list[PeerAgents] = []
    evict_peers: list[str] = []
    reads: list[ReadSpec] = []
    poll_notifications: bool = False  # this engine holds leased blocks: poll at least every 1 ms


# --- rank -> engine, per step ----------------------------------------------------------------

class NotificationKind(enum.Enum):
    DONE = "done"
    ABORT = "abort"


class Notification(msgspec.Struct, frozen=True):
    """Sent by a consumer rank to each producer rank it read from, once its READ finished."""

    producer_request_id: str
    consumer_engine_id: str
    consumer_rank: int
    consumer_tp_size: int
    kind: NotificationKind


class ReceivedNotification(msgspec.Struct, frozen=True):
    producer_rank: int
    sender: str  # the transport agent it came from
    notification: Notification


class ReadFailure(msgspec.Struct, frozen=True):
    request_id: str
    engine_id: str
    reason: str
    peer_gone: bool  # the producer is unreachable: evict it so the next request handshakes again
    in_doubt: bool = False  # a READ timed out and may still land: quarantine the local blocks


class ReadDone(msgspec.Struct, frozen=True):
    request_id: str
    num_bytes: int
    num_descriptors: int
    duration_s: float


class ConnectorReport(msgspec.Struct):
    done: list[ReadDone] = []
    failed: list[ReadFailure] = []
    notifications: list[ReceivedNotification] = []
    num_bad_notifications: int = 0  # received but undecodable


# --- consumer engine <-> producer engine, side channel ------------------------------------------

class HandshakeRequest(msgspec.Struct, frozen=True, tag="handshake"):
    version: int
    engine_id: str  # the producer engine the consumer expects to reach
    ranks: list[int]  # union of producer ranks the consumer's ranks read from


class HandshakeReply(msgspec.Struct, frozen=True, tag="handshake_reply"):
    """Checked in two stages: version, engine id and fingerprint first, then `payload` is decoded."""

    version: int
    engine_id: str
    fingerprint: Fingerprint | None = None
    payload: bytes = b""  # msgpack HandshakePayload
    error: str = ""


class HandshakePayload(msgspec.Struct, frozen=True):
    producer_tp_size: int
    ranks: list[RankAgent]


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat"):
    consumer_engine_id: str
    consumer_tp_size: int
    request_ids: list[str]  # producer request ids


class HeartbeatAck(msgspec.Struct, frozen=True, tag="heartbeat_ack"):
    alive: list[bool]  # per request id: still leased (renewed now)
    lease_s: float
    quarantine_s: float  # how long expired blocks stay out of reuse: a READ must end well before


class Release(msgspec.Struct, frozen=True, tag="release"):
    """The consumer gave up on these requests: free their blocks now."""

    consumer_engine_id: str
    request_ids: list[str]
    reason: str


class ReleaseAck(msgspec.Struct, frozen=True, tag="release_ack"):
    num_released: int


SideChannelRequest = HandshakeRequest | Heartbeat | Release
SideChannelReply = HandshakeReply | HeartbeatAck | ReleaseAck
