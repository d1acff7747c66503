"""The ZMQ side channel between a consumer engine and a producer engine (docs/design.md, "Handshake").

Engine processes, one background thread on each side, so no ZMQ socket is shared between threads
and the step loop never waits on the network:
* `SideChannelServer` (producer): a ROUTER bound to the configured host (port 0 = any, reported).
* `SideChannelClient` (consumer): one DEALER per producer address, every exchange asynchronous with
  its own timeout, so handshakes with different producers run concurrently.
Frames, MACs and replay refusal are frames.py's; the server answers every request it cannot take
(unauthenticated, replayed, malformed, too big in its lists) with a typed `ErrorReply` and logs
each kind at most every 10 s. `ZmqNetwork` makes both; `transport.loopback.LoopbackNetwork` is its
in-process stand-in.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from typing import Callable

import msgspec
import zmq

from pdserve.kv_transfer.frames import (MAX_REPLY_BYTES, MAX_REQUEST_BYTES, ReplayWindow, encode_reply,
                                        encode_request, new_client_id, parse_header, verify)
from pdserve.kv_transfer.messages import ErrorReply, SideChannelReply, SideChannelRequest
from pdserve.transport.deferred import Deferred

__all__ = ["ZmqNetwork", "SideChannelServer", "SideChannelClient", "SideChannelError", "encode_request"]

logger = logging.getLogger(__name__)

DEFERRED_POLL_MS = 1  # while a reply waits for the engine thread
_request_decoder = msgspec.msgpack.Decoder(SideChannelRequest)
_reply_decoder = msgspec.msgpack.Decoder(SideChannelReply)
LOG_EVERY_S = 10.0


class SideChannelError(RuntimeError):
    pass


class ZmqNetwork:
    """The side channel's real network: ZMQ over TCP, HMAC-signed when a secret is set."""

    def __init__(self, secret: bytes | None, previous: bytes | None = None):
        self.secret = secret
        self.previous = previous  # accepted too while the secret rotates (docs/security.md)

    def serve(self, host: str, port: int, handler: Callable[[object], object]) -> "SideChannelServer":
        return SideChannelServer(host, port, self.secret, handler, self.previous)

    def client(self) -> "SideChannelClient":
        return SideChannelClient(self.secret, self.previous)


class SideChannelServer:
    """Answers requests with `handler(request) -> reply`, called on the server thread; a `Deferred`
    reply is sent when another thread resolves it (or its fallback at its deadline), while the
    server goes on answering others."""

    def __init__(self, host: str, port: int, secret: bytes | None,
                 handler: Callable[[object], object], previous: bytes | None = None):
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)  # larger: the connection is dropped
        endpoint = f"tcp://[{host}]:{port or '*'}" if ":" in host else f"tcp://{host}:{port or '*'}"
        if ":" in host:
            self._sock.setsockopt(zmq.IPV6, 1)
        self._sock.bind(endpoint)
        self.port = int(self._sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self._secret = secret
        self._previous = previous
        self._handler = handler
        self._replays = ReplayWindow()
        self._logged: dict[str, float] = {}
        self._stop = threading.Event()
        self.num_refused = 0
        self._deferred: list[tuple[bytes, bytes, Deferred]] = []  # (peer, header, reply to come)
        self._thread = threading.Thread(target=self._run, name="pdserve-side-channel", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            self._send_deferred()
            if not poller.poll(DEFERRED_POLL_MS if self._deferred else 200):
                continue
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            try:
                out = self._answer(frames[1:])
            except Exception as e:  # noqa: BLE001 - a bad peer never kills the listener
                logger.exception("side channel: cannot handle a request")
                out = ErrorReply(f"internal error: {type(e).__name__}")
            head = frames[2] if len(frames) == 4 else b""
            if isinstance(out, Deferred):
                self._deferred.append((frames[0], head, out))
            else:
                self._sock.send_multipart([frames[0], *encode_reply(self._secret, head, out)])
        self._sock.close(0)

    def _send_deferred(self) -> None:
        still = []
        for peer, head, deferred in self._deferred:
            out = deferred.result()
            if out is None:
                still.append((peer, head, deferred))
            else:
                self._sock.send_multipart([peer, *encode_reply(self._secret, head, out)])
        self._deferred = still

    def _answer(self, frames: list[bytes]):
        """The reply to one request (an ErrorReply when it cannot be taken)."""
        if len(frames) != 3 or parse_header(frames[1]) is None:
            return self._refuse("malformed frames", "malformed request: expected [mac, header, body] frames")
        tag, head, body = frames
        if not verify(self._secret, tag, head, body, self._previous):
            return self._refuse("unauthenticated", "unauthenticated: the request's HMAC is missing or wrong "
                                                   "(is the same shared secret set on both sides?)")
        if self._secret is not None and not self._replays.accept(*parse_header(head)):
            return self._refuse("replayed", "replayed: this sequence number was already seen")
        try:
            msg = _request_decoder.decode(body)
        except msgspec.DecodeError as e:  # includes lists over their bound
            return self._refuse("malformed", f"malformed message: {e}")
        return self._handler(msg)

    def _refuse(self, kind: str, message: str) -> ErrorReply:
        self.num_refused += 1
        now = time.monotonic()
        if now - self._logged.get(kind, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._logged[kind] = now
            logger.warning("side channel: refused a request (%s; %d refused in all)", kind, self.num_refused)
        return ErrorReply(message)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


class SideChannelClient:
    """Asynchronous request/reply to many producers from one thread. `send` returns at once;
    `on_reply(reply_or_exception)` is called on the client thread."""

    def __init__(self, secret: bytes | None, previous: bytes | None = None):
        self._secret = secret
        self._previous = previous
        self._client_id = new_client_id()
        self._ctx = zmq.Context.instance()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_addr = f"inproc://pdserve-client-{uuid.uuid4().hex}"
        self._wake_recv = self._ctx.socket(zmq.PAIR)
        self._wake_recv.bind(self._wake_addr)
        self._wake_send = self._ctx.socket(zmq.PAIR)
        self._wake_send.connect(self._wake_addr)
        self._wake_lock = threading.Lock()
        self._wake_closed = False  # under _wake_lock: the client thread closed the wake socket
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="pdserve-side-client", daemon=True)
        self._thread.start()

    def send(self, host: str, port: int, request, timeout_s: float,
             on_reply: Callable[[object], None]) -> None:
        self._inbox.put((host, port, request, timeout_s, on_reply))
        self._wake()

    def close(self) -> None:
        self._stop = True
        self._wake()
        self._thread.join(timeout=2)

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_closed:  # the thread has ended (a close, or a send racing one)
                return
            try:
                self._wake_send.send(b"", zmq.NOBLOCK)
            except zmq.Again:  # wake-ups already queued: the thread will see the inbox anyway
                pass

    def _run(self) -> None:
        self._sockets: dict[tuple[str, int], zmq.Socket] = {}
        self._last_used: dict[tuple[str, int], float] = {}
        self._pending: dict[int, tuple[float, Callable, int]] = {}  # seq -> (deadline, callback, socket id)
        self._seq = 0
        self._poller = zmq.Poller()
        self._poller.register(self._wake_recv, zmq.POLLIN)
        while not self._stop:
            try:
                self._turn()
            except Exception:  # noqa: BLE001 - the thread that enforces every timeout must live
                logger.exception("side channel client: unexpected error")
        for sock in self._sockets.values():
            sock.close(0)
        self._wake_recv.close(0)
        with self._wake_lock:
            self._wake_closed = True
            self._wake_send.close(0)

    def _turn(self) -> None:
        timeout_ms = 1000
        if self._pending:
            nearest = min(d for d, _, _ in self._pending.values())
            timeout_ms = max(0, int((nearest - time.monotonic()) * 1000) + 1)
        events = dict(self._poller.poll(timeout_ms))
        if self._wake_recv in events:
            while self._wake_recv.poll(0):
                self._wake_recv.recv()
        while True:
            try:
                host, port, request, timeout_s, on_reply = self._inbox.get_nowait()
            except queue.Empty:
                break
            self._send_one(host, port, request, timeout_s, on_reply)
        for sock in list(self._sockets.values()):
            if sock in events:
                self._receive(sock)
        now = time.monotonic()
        for key, (deadline, on_reply, _) in list(self._pending.items()):
            if deadline <= now:
                del self._pending[key]
                _call(on_reply, TimeoutError("no answer within the timeout"))
        self._close_idle(now)

    def _send_one(self, host, port, request, timeout_s, on_reply) -> None:
        addr = (host, port)
        try:
            sock = self._sockets.get(addr)
            if sock is None:
                sock = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
                try:
                    if ":" in host:
                        sock.setsockopt(zmq.IPV6, 1)
                    sock.connect(f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}")
                except zmq.ZMQError:
                    sock.close(0)
                    raise
                self._sockets[addr] = sock
                self._poller.register(sock, zmq.POLLIN)
            self._last_used[addr] = time.monotonic()
            self._seq += 1
            sock.send_multipart(encode_request(self._secret, self._client_id, self._seq, request), zmq.NOBLOCK)
            self._pending[self._seq] = (time.monotonic() + timeout_s, on_reply, id(sock))
        except zmq.ZMQError as e:
            _call(on_reply, SideChannelError(f"cannot reach {host}:{port}: {e}"))

    def _receive(self, sock) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            parsed = parse_header(frames[1]) if len(frames) == 3 else None
            if parsed is None or parsed[0] != self._client_id:
                continue
            tag, head, body = frames
            entry = self._pending.pop(parsed[1], None)
            if entry is None:
                continue  # answered after its timeout
            if not verify(self._secret, tag, head, body, self._previous):
                _call(entry[1], SideChannelError("reply without a valid HMAC"))
                continue
            try:
                reply = _reply_decoder.decode(body)
            except msgspec.DecodeError as e:
                reply = SideChannelError(f"undecodable reply: {e}")
            _call(entry[1], reply)

    def _close_idle(self, now: float) -> None:
        """A DEALER unused for a minute with nothing pending is closed (bogus addresses do not
        accumulate sockets)."""
        busy = {sock_id for _, _, sock_id in self._pending.values()}
        for addr, last in list(self._last_used.items()):
            sock = self._sockets[addr]
            if now - last > IDLE_SOCKET_S and id(sock) not in busy:
                self._poller.unregister(sock)
                sock.close(0)
                del self._sockets[addr], self._last_used[addr]


IDLE_SOCKET_S = 60.0


def _call(on_reply: Callable[[object], None], reply) -> None:
    try:
        on_reply(reply)
    except Exception:  # noqa: BLE001
        logger.exception("side channel: reply callback failed")
