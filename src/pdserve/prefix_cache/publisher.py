"""Publishes an instance's KV events over ZMQ the way vLLM does: PUB frames
`[topic, sequence (8 bytes, big-endian), msgpack(EventBatch)]`, and an optional ROUTER replay socket.

Engine process. `emit` (engine thread) queues events; a publisher thread seals them into a batch
and sends it within `coalesce_s` of the first one, whether or not the engine steps again, and
serves replay requests: a client sends a start sequence (8 bytes, big-endian) and gets every
buffered batch from it as `[sequence, payload]`, then `[-1, b""]`. `flush` seals what is queued at
once and returns the last sequence number, so a snapshot taken right after is consistent with it.
The thread owns the sockets; one lock orders sequence numbers and the replay buffer.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Callable
from urllib.parse import urlsplit

import zmq

from pdserve.config import KVEventsConfig, is_loopback
from pdserve.health import EventEndpoints
from pdserve.prefix_cache.events import Event, EventBatch, encode_batch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
COALESCE_S = 0.005  # events of one engine step go out as one batch, still far below 20 ms


def binds(endpoint: str) -> bool:
    """vLLM's rule (bind on a wildcard, ipc or inproc; else connect), plus port 0: it can only bind."""
    return ("*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
            or endpoint.rsplit(":", 1)[-1] == "0")


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig, topic: str, data_parallel_rank: int = 0,
                 clock: Callable[[], float] = time.time, coalesce_s: float = COALESCE_S):
        self.config = config
        self.topic = topic
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._clock = clock
        self._coalesce_s = coalesce_s
        self._lock = threading.Lock()
        self._pending: list[Event] = []
        self._dropped = False  # events were dropped since the last batch: skip a sequence number
        self._seq = -1
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.buffer_steps)
        self._outbox: collections.deque[tuple[int, bytes]] = collections.deque()
        self._closing = False
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            self.endpoint = _attach(self._pub, config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self.replay_endpoint = _attach(self._replay, config.replay_endpoint, bind=True)
            else:
                self.replay_endpoint = None
        except zmq.ZMQError:
            self._close_sockets()
            raise
        for ep in (self.endpoint, self.replay_endpoint):
            host = urlsplit(ep).hostname if ep and ep.startswith("tcp://") else None
            if host and not is_loopback(host):
                logger.warning("KV events on %s: every block's token ids are readable from other hosts", ep)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="pdserve-kv-events", daemon=True)
        self._thread.start()

    # --- any thread ------------------------------------------------------------------------------

    def emit(self, events: list[Event]) -> None:
        if not events:
            return
        with self._lock:
            first = not self._pending
            if len(self._pending) + len(events) > self.config.max_queue_size:
                self._pending.clear()
                self._dropped = True
                logger.warning("KV events: more than %d queued; dropped (subscribers see a gap)",
                               self.config.max_queue_size)
            self._pending.extend(events)
            if first:
                self._wake()

    def flush(self) -> int:
        """Seal queued events into a batch now; the sequence number of the last batch (-1: none)."""
        with self._lock:
            self._seal()
            if self._outbox:
                self._wake()
            return self._seq

    def info(self) -> EventEndpoints:
        return EventEndpoints(endpoint=self.endpoint, replay_endpoint=self.replay_endpoint, topic=self.topic,
                              encoding=self.config.encoding, last_seq=self._seq)

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued, then stop the thread and close the sockets."""
        with self._lock:
            self._closing = True
            self._wake()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("KV events publisher thread did not stop within %.1f s", timeout_s)
            return
        self._close_sockets()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # --- under the lock ------------------------------------------------------------------------

    def _seal(self) -> None:
        if not self._pending:
            return
        self._seq += 2 if self._dropped else 1
        self._dropped = False
        batch = EventBatch(ts=self._clock(), events=self._pending, data_parallel_rank=self._rank)
        self._pending = []
        payload = encode_batch(batch, self.config.encoding)
        self._buffer.append((self._seq, payload))
        self._outbox.append((self._seq, payload))

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:  # the pipe is full: the thread is awake already
            pass

    # --- the publisher thread ------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._wake_r in ready:
                _drain(self._wake_r)
                with self._lock:
                    closing = self._closing
                if not closing:
                    time.sleep(self._coalesce_s)  # let the rest of this step's events join the batch
                with self._lock:
                    self._seal()
                    out = list(self._outbox)
                    self._outbox.clear()
                for seq, payload in out:
                    self._send(seq, payload)
                if closing:
                    return
            if self._replay is not None and self._replay in ready:
                self._serve_replay()

    def _send(self, seq: int, payload: bytes) -> None:
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:  # high-water mark reached: subscribers see a gap and replay
            logger.warning("KV events: batch %d dropped at the high-water mark", seq)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        # [client, b"", start] from a REQ or a DEALER with a delimiter; [client, start] without one.
        client, envelope, start = frames[0], frames[1:-1], frames[-1]
        with self._lock:
            batches = list(self._buffer)
        if len(frames) in (2, 3) and len(start) == 8:
            first = int.from_bytes(start, "big", signed=True)
            for seq, payload in batches:
                if seq >= first:
                    self._replay.send_multipart((client, *envelope, seq.to_bytes(8, "big"), payload))
        else:
            logger.warning("KV events: malformed replay request (%d frames)", len(frames))
        self._replay.send_multipart((client, *envelope, END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()


def _attach(sock: zmq.Socket, endpoint: str, bind: bool | None = None) -> str:
    """Bind or connect; the address subscribers reach (the bound port when it was 0 or `*`)."""
    if bind or (bind is None and binds(endpoint)):
        sock.bind(endpoint)
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)
    sock.connect(endpoint)
    return endpoint


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass
