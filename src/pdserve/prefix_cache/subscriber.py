"""Reading an instance's KV events: a ZMQ subscriber with replay, the index they build, and a
follower that keeps the index exact when messages are lost.

Any process that tracks what instances cache (a router, a test). `BlockIndex` applies batches in
sequence order and says when it missed one (`gap`). `KVEventFollower` repairs gaps itself: it
replays from the first missing batch, and loads a snapshot (`/kv/events/snapshot`) when replay
cannot fill the gap. Every wait is bounded.
"""

from __future__ import annotations

import random
import time
import urllib.request
from typing import Callable

import msgspec
import zmq

from pdserve.prefix_cache.events import (AllBlocksCleared, BlockRemoved, BlockStored, EventBatch,
                                         Snapshot, decode_batch)


class BlockIndex:
    """The set of block hashes one instance holds, as its events say."""

    def __init__(self):
        self.hashes: set[int] = set()
        self.next_seq = 0  # the batch expected next
        self.gap = False  # a batch was missed: replay from next_seq, or load a snapshot

    def apply(self, seq: int, batch: EventBatch) -> bool:
        """Apply batch `seq` if it is the next one; False for a duplicate, or after a gap."""
        if seq < self.next_seq:
            return False
        if seq > self.next_seq:
            self.gap = True
            return False
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.hashes.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.hashes.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.hashes.clear()
        self.next_seq = seq + 1
        self.gap = False
        return True

    def load(self, snapshot: Snapshot) -> None:
        self.hashes = {h for b in snapshot.blocks for h in b.block_hashes}
        self.next_seq = snapshot.seq + 1
        self.gap = False


class KVEventSubscriber:
    """`drop_fraction` loses that share of the published batches on purpose, before they are
    decoded (seeded: the same messages every run), for tests and benchmarks of recovery."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 drop_fraction: float = 0.0, seed: int = 0):
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self._drop_fraction = drop_fraction
        self._rng = random.Random(seed)
        self.num_received = 0  # published batches that arrived, dropped ones included
        self.num_dropped = 0

    def recv(self, timeout_s: float) -> tuple[str, int, EventBatch] | None:
        """The next published batch as (topic, sequence, batch), or None after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = max(0.0, deadline - time.monotonic())
            if not self._sub.poll(int(left * 1000)):
                return None
            topic, seq, payload = self._sub.recv_multipart()
            self.num_received += 1
            if self._drop_fraction and self._rng.random() < self._drop_fraction:
                self.num_dropped += 1
                continue
            return topic.decode(), int.from_bytes(seq, "big"), decode_batch(payload)

    def replay(self, start_seq: int, timeout_s: float = 5.0) -> list[tuple[int, EventBatch]]:
        """Every batch the publisher still buffers from `start_seq` on, in order."""
        if self._replay_endpoint is None:
            raise ValueError("no replay endpoint")
        sock = self._ctx.socket(zmq.DEALER)
        sock.connect(self._replay_endpoint)
        try:
            sock.send_multipart((b"", start_seq.to_bytes(8, "big")))
            deadline = time.monotonic() + timeout_s
            batches = []
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000)):
                    raise TimeoutError(f"replay from {start_seq} did not end within {timeout_s} s")
                _, seq, payload = sock.recv_multipart()
                n = int.from_bytes(seq, "big", signed=True)
                if n == -1:
                    return batches
                batches.append((n, decode_batch(payload)))
        finally:
            sock.close(linger=0)

    def close(self) -> None:
        self._sub.close(linger=0)
        self._ctx.term()


def http_snapshot(base_url: str, api_key: str | None = None,
                  timeout_s: float = 5.0) -> Callable[[], Snapshot]:
    """A function fetching an instance's snapshot (`GET /kv/events/snapshot`), for the follower."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def fetch() -> Snapshot:
        req = urllib.request.Request(base_url.rstrip("/") + "/kv/events/snapshot", headers=headers)
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return msgspec.json.decode(r.read(), type=Snapshot)
    return fetch


class KVEventFollower:
    """Applies one instance's batches to a `BlockIndex` and keeps it exact when batches are lost.

    A gap (a batch ahead of `next_seq`) is filled by replay from the first missing batch. Replay
    cannot fill it when the publisher no longer buffers that batch or skipped its number (queue
    overflow); then the follower loads a snapshot and goes on from the snapshot's sequence. A lost
    *last* batch shows no gap until the next one, so a stream quiet for `idle_s` is checked by a
    replay from `next_seq` (one round trip; empty when nothing was missed). A batch lost after that
    check is found when the publisher says it sealed it (`published`, from the instance's /health):
    a quiet stream behind the publisher is replayed again."""

    def __init__(self, subscriber: KVEventSubscriber, snapshot: Callable[[], Snapshot] | None = None,
                 index: BlockIndex | None = None, idle_s: float = 0.1, replay_timeout_s: float = 2.0):
        self.subscriber = subscriber
        self.index = index or BlockIndex()
        self._snapshot = snapshot
        self._idle_s = idle_s
        self._replay_timeout_s = replay_timeout_s
        self._checked = True  # nothing applied since the last replay check
        self._published_seq = -1  # the last batch the publisher says it sealed
        self.num_gaps = 0  # gaps found (from sequence numbers or a quiet-stream check)
        self.num_replayed = 0  # batches applied from replay
        self.num_snapshots = 0  # snapshots loaded because replay could not fill a gap

    def poll(self, timeout_s: float | None = None) -> None:
        """Apply the next published batch, or after `timeout_s` (default `idle_s`) of quiet check
        by replay that nothing was missed (once per quiet spell, and while the publisher says it
        sealed a batch this follower has not applied)."""
        got = self.subscriber.recv(self._idle_s if timeout_s is None else timeout_s)
        if got is None:
            if not self._checked or self._published_seq >= self.index.next_seq:
                self._check_quiet()
                self._checked = not self.index.gap  # a failed repair is tried again
            return
        _, seq, batch = got
        self._checked = False
        if self.index.apply(seq, batch) or not self.index.gap:
            return  # applied, or a duplicate of a replayed batch
        self.num_gaps += 1
        self._resync()
        self.index.apply(seq, batch)  # unless the repair already covered it

    def published(self, seq: int) -> None:
        """The publisher has sealed batches up to `seq` (its /health's `last_seq`; any thread): if
        the stream goes quiet before they arrive, they were lost, and the next quiet poll replays."""
        self._published_seq = seq

    def follow_until(self, done: Callable[[BlockIndex], bool], timeout_s: float) -> bool:
        """Poll until `done(index)`; False when `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        while not done(self.index):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.poll(min(self._idle_s, left))
        return True

    def _check_quiet(self) -> None:
        replayed, snapshots = self.num_replayed, self.num_snapshots
        self._resync()
        if (self.num_replayed, self.num_snapshots) != (replayed, snapshots):
            self.num_gaps += 1  # the stream's last batches were lost

    def _resync(self) -> None:
        """Replay from `next_seq`; a snapshot if the reply has a hole (or replay is unreachable)."""
        self._apply_replayed(self._replay_batches(self.index.next_seq))
        if self.index.gap:
            self._load_snapshot()

    def _replay_batches(self, start: int) -> list[tuple[int, EventBatch]] | None:
        try:
            return self.subscriber.replay(start, self._replay_timeout_s)
        except (TimeoutError, ValueError, zmq.ZMQError):  # no replay endpoint, or it is down
            return None

    def _apply_replayed(self, batches: list[tuple[int, EventBatch]] | None) -> None:
        if batches is None:
            self.index.gap = True
            return
        for seq, batch in batches:
            if self.index.apply(seq, batch):
                self.num_replayed += 1
            elif self.index.gap:
                return  # a hole replay cannot fill

    def _load_snapshot(self) -> None:
        if self._snapshot is None:
            return  # stays in gap; the next batch or quiet spell tries again
        try:
            snapshot = self._snapshot()
        except (OSError, msgspec.DecodeError):  # the instance is unreachable: try again later
            return
        self.index.load(snapshot)
        self.num_snapshots += 1
        self._apply_replayed(self._replay_batches(self.index.next_seq))
