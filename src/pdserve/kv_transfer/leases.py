"""Producer-side leases: who holds which blocks for a remote reader, until when.

Engine process of a producer. Shared by two threads under one lock: the side-channel thread renews
(heartbeats) and releases (consumer gave up); the engine thread records rank notifications, expires
leases and frees blocks. A lease is freed when every expected (consumer rank, producer rank) read
has been notified (a set: duplicates cannot free early), on release, or on expiry (quarantined
first if a consumer bound it) (docs/design.md, "Block lifecycle").
"""

from __future__ import annotations

import dataclasses
import enum
import threading

from pdserve.kv_transfer.messages import LeaseAnswer, Notification, NotificationKind
from pdserve.kv_transfer.topology import expected_reads


class LeaseState(enum.Enum):
    HELD = "held"
    DONE = "done"  # every expected read notified: free now
    RELEASED = "released"  # the consumer gave up: free now
    EXPIRED = "expired"  # no heartbeat in time: quarantine (if bound), then free


_TRANSITIONS = {LeaseState.HELD: {LeaseState.DONE, LeaseState.RELEASED, LeaseState.EXPIRED}}


@dataclasses.dataclass
class Lease:
    request_id: str
    block_ids: list[int]
    deadline: float
    digest: str  # of the params it was issued with (KVTransferParams.lease_digest)
    state: LeaseState = LeaseState.HELD
    consumer_engine_id: str | None = None
    expected: frozenset[tuple[int, int]] | None = None
    received: set[tuple[int, int]] = dataclasses.field(default_factory=set)

    def move_to(self, state: LeaseState) -> None:
        assert state in _TRANSITIONS.get(self.state, ()), f"lease {self.request_id}: {self.state} -> {state}"
        self.state = state

    def bind(self, consumer_engine_id: str, consumer_tp_size: int, producer_tp_size: int,
             num_kv_heads: int) -> bool:
        """The first consumer to speak for this lease owns it; others are refused, and so is a
        consumer TP size that cannot shard the heads (it comes from the network)."""
        if self.consumer_engine_id is None:
            try:
                self.expected = expected_reads(producer_tp_size, consumer_tp_size, num_kv_heads)
            except (ValueError, TypeError, ZeroDivisionError):
                return False
            self.consumer_engine_id = consumer_engine_id
        return self.consumer_engine_id == consumer_engine_id


class LeaseTable:
    def __init__(self, lease_s: float, producer_tp_size: int, num_kv_heads: int):
        self.lease_s = lease_s
        self.producer_tp_size = producer_tp_size
        self.num_kv_heads = num_kv_heads
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self.num_expired = 0
        self.num_released = 0
        self.num_ignored = 0
        self.num_heartbeats = 0

    def __len__(self) -> int:
        return len(self._leases)

    @property
    def num_blocks(self) -> int:
        with self._lock:
            return sum(len(l.block_ids) for l in self._leases.values())

    def add(self, request_id: str, block_ids: list[int], digest: str, now: float) -> Lease:
        """A new lease. Request ids are the engine's own, unique per request: one that is still
        leased would lose its blocks if replaced, so that is a bug here, never the client's doing."""
        with self._lock:
            assert request_id not in self._leases, f"lease {request_id} exists: its blocks would leak"
            lease = Lease(request_id, list(block_ids), now + self.lease_s, digest)
            self._leases[request_id] = lease
            return lease

    def heartbeat(self, consumer_engine_id: str, consumer_tp_size: int, request_ids: list[str],
                  digests: list[str], now: float) -> list[LeaseAnswer]:
        """Renew each lease held for this consumer and issued with the params it names."""
        answers = []
        digests = list(digests) + [""] * (len(request_ids) - len(digests))
        with self._lock:
            self.num_heartbeats += 1
            for rid, digest in zip(request_ids, digests):
                lease = self._leases.get(rid)
                if lease is None or lease.state != LeaseState.HELD:
                    answers.append(LeaseAnswer.GONE)
                elif digest != lease.digest:
                    answers.append(LeaseAnswer.MISMATCH)
                elif not lease.bind(consumer_engine_id, consumer_tp_size, self.producer_tp_size,
                                    self.num_kv_heads):
                    answers.append(LeaseAnswer.TAKEN)
                else:
                    lease.deadline = now + self.lease_s
                    answers.append(LeaseAnswer.HELD)
        return answers

    def release(self, consumer_engine_id: str, request_ids: list[str]) -> int:
        n = 0
        with self._lock:
            for rid in request_ids:
                lease = self._leases.get(rid)
                if lease is not None and lease.state == LeaseState.HELD and \
                        lease.consumer_engine_id in (None, consumer_engine_id):
                    lease.move_to(LeaseState.RELEASED)
                    self.num_released += 1
                    n += 1
        return n

    def release_unclaimed(self, request_id: str, digest: str) -> bool:
        """Free a lease no consumer has bound yet (given its params' digest)."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.state != LeaseState.HELD or lease.consumer_engine_id is not None \
                    or lease.digest != digest:
                return False
            lease.move_to(LeaseState.RELEASED)
            self.num_released += 1
            return True

    def release_undelivered(self, request_id: str) -> bool:
        """This producer's own client never got the params (it left): free the lease, unless a
        consumer bound it anyway (then that consumer decides)."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.state != LeaseState.HELD or lease.consumer_engine_id is not None:
                return False
            lease.move_to(LeaseState.RELEASED)
            self.num_released += 1
            return True

    def notify(self, producer_rank: int, sender: str, note: Notification) -> bool:
        """Record one rank's notification. False when it is unknown or late, or does not come from
        the consumer the lease is bound to (by its first heartbeat), from the agent of the rank it
        names."""
        with self._lock:
            lease = self._leases.get(note.producer_request_id)
            if lease is None or lease.state != LeaseState.HELD or lease.consumer_engine_id is None \
                    or note.consumer_engine_id != lease.consumer_engine_id \
                    or sender != f"{lease.consumer_engine_id}/rank{note.consumer_rank}":
                self.num_ignored += 1
                return False
            if note.kind == NotificationKind.ABORT:
                lease.move_to(LeaseState.RELEASED)
                self.num_released += 1
                return True
            pair = (note.consumer_rank, producer_rank)
            if pair not in lease.expected:
                self.num_ignored += 1
                return False
            lease.received.add(pair)
            if lease.received >= lease.expected:
                lease.move_to(LeaseState.DONE)
            return True

    def collect(self, now: float) -> tuple[list[Lease], list[Lease]]:
        """Remove and return (leases to free now, leases to quarantine). An expired lease no
        consumer ever bound is freed: only a bound consumer posts READs (within the heartbeats
        this table acknowledged), so none can be in flight."""
        free, expired = [], []
        with self._lock:
            for rid, lease in list(self._leases.items()):
                if lease.state == LeaseState.HELD and lease.deadline <= now:
                    lease.move_to(LeaseState.EXPIRED)
                    self.num_expired += 1
                if lease.state in (LeaseState.DONE, LeaseState.RELEASED) or \
                        (lease.state == LeaseState.EXPIRED and lease.consumer_engine_id is None):
                    free.append(self._leases.pop(rid))
                elif lease.state == LeaseState.EXPIRED:
                    expired.append(self._leases.pop(rid))
        return free, expired

    def next_deadline(self) -> float | None:
        with self._lock:
            return min((l.deadline for l in self._leases.values()), default=None)
