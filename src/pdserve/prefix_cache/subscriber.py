"""Reading an instance's KV events: a ZMQ subscriber with replay, and the index they build.

Any process that tracks what instances cache (a router, a test). `BlockIndex` applies batches in
sequence order and says when it missed one (`gap`): the caller replays from `next_seq`, or loads a
snapshot (`/kv/events/snapshot`) and goes on from its sequence. Every wait is bounded.
"""

from __future__ import annotations

import time

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
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = ""):
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint

    def recv(self, timeout_s: float) -> tuple[str, int, EventBatch] | None:
        """The next published batch as (topic, sequence, batch), or None after `timeout_s`."""
        if not self._sub.poll(int(timeout_s * 1000)):
            return None
        topic, seq, payload = self._sub.recv_multipart()
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
