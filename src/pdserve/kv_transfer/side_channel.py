"""The ZMQ side channel between a consumer engine and a producer engine (DESIGN §3).

Engine processes, one background thread on each side, so no ZMQ socket is shared between threads
and the step loop never waits on the network:
* `SideChannelServer` (producer): a ROUTER bound to the configured host (port 0 = any, reported).
* `SideChannelClient` (consumer): one DEALER per producer address, every exchange asynchronous with
  its own timeout, so handshakes with different producers run concurrently.
Frames are [hmac, seq, msgpack body]; with a shared secret every request and reply carries an
HMAC-SHA256 of seq + body, and the server refuses requests whose HMAC does not verify.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import queue
import threading
import time
import uuid
from typing import Callable

import msgspec
import zmq

from pdserve.kv_transfer.messages import (HANDSHAKE_VERSION, HandshakeReply, SideChannelReply,
                                          SideChannelRequest)

logger = logging.getLogger(__name__)

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(SideChannelRequest)
_reply_decoder = msgspec.msgpack.Decoder(SideChannelReply)


class SideChannelError(RuntimeError):
    pass


def _mac(secret: bytes | None, seq: bytes, body: bytes) -> bytes:
    return hmac.new(secret, seq + body, hashlib.sha256).digest() if secret else b""


def _verify(secret: bytes | None, mac: bytes, seq: bytes, body: bytes) -> bool:
    return not secret or hmac.compare_digest(mac, _mac(secret, seq, body))


class SideChannelServer:
    """Answers requests with `handler(request) -> reply`, called on the server thread."""

    def __init__(self, host: str, port: int, secret: bytes | None,
                 handler: Callable[[object], object]):
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        endpoint = f"tcp://[{host}]:{port or '*'}" if ":" in host else f"tcp://{host}:{port or '*'}"
        if ":" in host:
            self._sock.setsockopt(zmq.IPV6, 1)
        self._sock.bind(endpoint)
        self.port = int(self._sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self._secret = secret
        self._handler = handler
        self._stop = threading.Event()
        self.num_refused = 0
        self._thread = threading.Thread(target=self._run, name="pdserve-side-channel", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(200):
                continue
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            if len(frames) != 4:
                self.num_refused += 1
                continue
            identity, mac, seq, body = frames
            if not _verify(self._secret, mac, seq, body):
                self.num_refused += 1
                logger.warning("side channel: refused a request without a valid HMAC")
                out = _encoder.encode(HandshakeReply(HANDSHAKE_VERSION, "", error=(
                    "unauthenticated: the request's HMAC is missing or wrong (is the shared "
                    "secret set on both sides?)")))
                self._sock.send_multipart([identity, b"", seq, out])
                continue
            try:
                reply = self._handler(_request_decoder.decode(body))
            except Exception:  # noqa: BLE001 - a bad peer never kills the listener
                logger.exception("side channel: cannot handle a request")
                self.num_refused += 1
                continue
            out = _encoder.encode(reply)
            self._sock.send_multipart([identity, _mac(self._secret, seq, out), seq, out])
        self._sock.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


class SideChannelClient:
    """Asynchronous request/reply to many producers from one thread. `send` returns at once;
    `on_reply(reply_or_exception)` is called on the client thread."""

    def __init__(self, secret: bytes | None):
        self._secret = secret
        self._ctx = zmq.Context.instance()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_addr = f"inproc://pdserve-client-{uuid.uuid4().hex}"
        self._wake_recv = self._ctx.socket(zmq.PAIR)
        self._wake_recv.bind(self._wake_addr)
        self._wake_send = self._ctx.socket(zmq.PAIR)
        self._wake_send.connect(self._wake_addr)
        self._wake_lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="pdserve-side-client", daemon=True)
        self._thread.start()

    def send(self, host: str, port: int, request, timeout_s: float,
             on_reply: Callable[[object], None]) -> None:
        self._inbox.put((host, port, request, timeout_s, on_reply))
        with self._wake_lock:
            self._wake_send.send(b"", zmq.NOBLOCK)

    def close(self) -> None:
        self._stop = True
        with self._wake_lock:
            self._wake_send.send(b"", zmq.NOBLOCK)
        self._thread.join(timeout=2)

    def _run(self) -> None:
        sockets: dict[tuple[str, int], zmq.Socket] = {}
        pending: dict[tuple[int, int], tuple[float, Callable]] = {}  # (socket id, seq) -> ...
        seq = 0
        poller = zmq.Poller()
        poller.register(self._wake_recv, zmq.POLLIN)
        while not self._stop:
            timeout_ms = 1000
            if pending:
                nearest = min(d for d, _ in pending.values())
                timeout_ms = max(0, int((nearest - time.monotonic()) * 1000) + 1)
            events = dict(poller.poll(timeout_ms))
            if self._wake_recv in events:
                while self._wake_recv.poll(0):
                    self._wake_recv.recv()
                while True:
                    try:
                        host, port, request, timeout_s, on_reply = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    sock = sockets.get((host, port))
                    if sock is None:
                        sock = self._ctx.socket(zmq.DEALER)
                        sock.setsockopt(zmq.LINGER, 0)
                        if ":" in host:
                            sock.setsockopt(zmq.IPV6, 1)
                        sock.connect(f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}")
                        sockets[(host, port)] = sock
                        poller.register(sock, zmq.POLLIN)
                    seq += 1
                    seq_b = seq.to_bytes(8, "little")
                    body = _encoder.encode(request)
                    try:
                        sock.send_multipart([_mac(self._secret, seq_b, body), seq_b, body], zmq.NOBLOCK)
                        pending[(id(sock), seq)] = (time.monotonic() + timeout_s, on_reply)
                    except zmq.ZMQError as e:
                        on_reply(SideChannelError(f"cannot send to {host}:{port}: {e}"))
            for sock in list(sockets.values()):
                if sock not in events:
                    continue
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if len(frames) != 3:
                        continue
                    mac, seq_b, body = frames
                    entry = pending.pop((id(sock), int.from_bytes(seq_b, "little")), None)
                    if entry is None:
                        continue  # answered after its timeout
                    if not _verify(self._secret, mac, seq_b, body):
                        entry[1](SideChannelError("reply without a valid HMAC"))
                        continue
                    try:
                        entry[1](_reply_decoder.decode(body))
                    except msgspec.DecodeError as e:
                        entry[1](SideChannelError(f"undecodable reply: {e}"))
            now = time.monotonic()
            for key, (deadline, on_reply) in list(pending.items()):
                if deadline <= now:
                    del pending[key]
                    on_reply(TimeoutError("no answer within the timeout"))
        for sock in sockets.values():
            sock.close(0)
        self._wake_recv.close(0)
        self._wake_send.close(0)
