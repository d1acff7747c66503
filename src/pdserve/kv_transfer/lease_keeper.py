"""The consumer's messages about the producer's leases: heartbeats and releases.

Engine process of a decode instance (engine thread; replies come back on the side channel's thread
as `HeartbeatReplied` events). Heartbeats go every third of the lease the producer acknowledged,
batched per producer and bounded per message, and show each lease the digest of the params held
for it; a release is sent once per load.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer.load import Load
from pdserve.kv_transfer.messages import MAX_IDS_PER_MESSAGE, Heartbeat, Release

MIN_HEARTBEAT_S = 0.05


@dataclasses.dataclass(frozen=True)
class HeartbeatReplied:
    """Side-channel thread -> engine thread: the answer to one heartbeat (or the exception)."""

    engine_id: str
    sent_at: float
    request_ids: list[str]  # consumer request ids, in the heartbeat's order
    reply: object


class LeaseKeeper:
    def __init__(self, config: KVTransferConfig, engine_id: str, tp_size: int, client,
                 clock: Callable[[], float], deliver: Callable[[HeartbeatReplied], None]):
        self.config = config
        self.engine_id = engine_id
        self.tp_size = tp_size
        self.client = client
        self.clock = clock
        self.deliver = deliver  # called on the side channel's thread
        self.num_heartbeats = 0

    def heartbeat(self, engine_id: str, host: str, port: int, loads: list[Load]) -> None:
        now = self.clock()
        for load in loads:
            load.last_heartbeat = now
        for i in range(0, len(loads), MAX_IDS_PER_MESSAGE):
            batch = loads[i:i + MAX_IDS_PER_MESSAGE]
            self.num_heartbeats += 1
            msg = Heartbeat(self.engine_id, self.tp_size, [l.params.remote_request_id for l in batch],
                            [l.params.lease_digest() for l in batch])
            ids = [l.request_id for l in batch]
            self.client.send(host, port, msg, self.config.handshake_timeout_s,
                             lambda reply, ids=ids: self.deliver(HeartbeatReplied(engine_id, now, ids, reply)))

    def release(self, load: Load, reason: str) -> None:
        """Tell the producer to free this request's blocks (once; it ignores repeats)."""
        if load.released:
            return
        load.released = True
        p = load.params
        self.client.send(p.remote_host, p.remote_port, Release(self.engine_id, [p.remote_request_id], reason),
                         self.config.handshake_timeout_s, lambda reply: None)

    def period(self, load: Load) -> float:
        """Every third of the lease the producer acknowledged (never faster than 20/s)."""
        return max(MIN_HEARTBEAT_S, (load.lease_s or self.config.lease_s) / 3)

    def due(self, load: Load, now: float) -> bool:
        return now - load.last_heartbeat >= self.period(load)

    def next_heartbeat(self, loads) -> float | None:
        return min((l.last_heartbeat + self.period(l) for l in loads), default=None)
