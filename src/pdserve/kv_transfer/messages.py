"""Typed messages of the KV transfer connector, by boundary.

* engine -> TP rank, once per step: `ConnectorMetadata`; TP rank -> engine: `ConnectorReport`
* TP rank -> engine, once at start: `RankAgent` (what a peer needs to read this rank's cache)
* consumer rank -> producer rank, over NIXL notifications: `Notification`
* consumer engine <-> producer engine, over the ZMQ side channel: `Handshake*`, `Heartbeat*`, `Release`;
  a producer pulling a conversation's history from a decode instance first asks it with a `Claim`
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

HANDSHAKE_VERSION = 2
MAX_IDS_PER_MESSAGE = 4096  # request ids one heartbeat or release names (the consumer batches)
Name = Annotated[str, msgspec.Meta(max_length=256)]
Ids = Annotated[list[Name], msgspec.Meta(max_length=MAX_IDS_PER_MESSAGE)]


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
    hostname: str = ""  # a peer on the same host should be read over shared memory or cma
    kv_cache_dtype: str = "float32"  # how the regions store K/V (model/kv_dtype.py)
    scale_region_addresses: list[int] = []  # fp8: one per region, same order; [blocks, heads, slot] float32
    scale_block_bytes: int = 0
    scale_head_bytes: int = 0


class Fingerprint(msgspec.Struct, frozen=True):
    """Everything two engines must agree on before one reads the other's cache."""

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    layout: str = "HND"
    kv_cache_dtype: str = "float32"  # may differ between peers when a converter exists (handshake.py)

    def differences(self, other: "Fingerprint", ignore: tuple[str, ...] = ()) -> list[str]:
        return [f"{f}: ours={getattr(self, f)!r} theirs={getattr(other, f)!r}"
                for f in self.__struct_fields__ if f not in ignore and getattr(self, f) != getattr(other, f)]


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
    """Sent by a consumer rank to each producer rank it read from, once its READ finished. Counted
    only from the agent `{consumer_engine_id}/rank{consumer_rank}` bound to the lease and, with a
    shared secret, only with a valid `mac` (HMAC over the other fields)."""

    producer_request_id: str
    consumer_engine_id: str
    consumer_rank: int
    consumer_tp_size: int
    kind: NotificationKind
    mac: bytes = b""


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
    warnings: list[str] = []  # new since the last report (a slow transport to a same-host peer)


# --- consumer engine <-> producer engine, side channel ------------------------------------------

class HandshakeRequest(msgspec.Struct, frozen=True, tag="handshake"):
    version: int
    engine_id: Name  # the producer engine the consumer expects to reach
    ranks: Annotated[list[int], msgspec.Meta(max_length=1024)]  # the producer ranks read from


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
    consumer_engine_id: Name
    consumer_tp_size: int
    request_ids: Ids  # producer request ids
    # Per request id, digest of the params the consumer holds (lease_digest): a lease answers only
    # to the params it was issued with, so block ids cannot be swapped under it.
    digests: Ids = []


class LeaseAnswer(enum.Enum):
    HELD = "held"  # renewed now
    GONE = "gone"  # unknown, expired or released
    MISMATCH = "mismatch"  # the consumer's params are not the ones this lease was issued with
    TAKEN = "taken"  # another consumer holds it


class HeartbeatAck(msgspec.Struct, frozen=True, tag="heartbeat_ack"):
    answers: list[LeaseAnswer]  # per request id
    lease_s: float
    quarantine_s: float  # how long expired blocks stay out of reuse: a READ must end well before

    @property
    def alive(self) -> list[bool]:
        return [a == LeaseAnswer.HELD for a in self.answers]


class Release(msgspec.Struct, frozen=True, tag="release"):
    """The consumer gave up on these requests: free their blocks now."""

    consumer_engine_id: Name
    request_ids: Ids
    reason: Annotated[str, msgspec.Meta(max_length=1024)]


class ReleaseAck(msgspec.Struct, frozen=True, tag="release_ack"):
    num_released: int


Digest = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]


class Claim(msgspec.Struct, frozen=True, tag="claim"):
    """A producer asks an instance that may hold a prompt's blocks (a decode instance that served
    the conversation's earlier turns) to lease the leading run of them it caches, by content hash
    (prefix_cache.hashing digests, in order), so that the producer READs them instead of
    computing them. The reply's lease is unbound, like a hand-off's: the claimer's first heartbeat
    binds it."""

    claimer_engine_id: Name
    block_hashes: Annotated[list[Digest], msgspec.Meta(max_length=MAX_IDS_PER_MESSAGE)]
    spare: bool = False  # the claimer keeps what it reads: the holder's copy becomes a spare one
    wait_s: Annotated[float, msgspec.Meta(ge=0, le=60)] = 1.0  # the holder's engine pins between its
    # steps: the claimer waits this long for it (a step may take seconds), then computes the blocks


class ClaimReply(msgspec.Struct, frozen=True, tag="claim_reply"):
    lease_id: str  # "" when none of the blocks is held here
    block_ids: list[int]  # the leading run of the claimed hashes this instance holds, in order
    holder_tp_size: int
    lease_s: float


class ErrorReply(msgspec.Struct, frozen=True, tag="error"):
    """A request the server could not take (unauthenticated, replayed, malformed, over a bound)."""

    error: str


SideChannelRequest = HandshakeRequest | Heartbeat | Release | Claim
SideChannelReply = HandshakeReply | HeartbeatAck | ReleaseAck | ClaimReply | ErrorReply
