"""The side channel's frames and what makes them safe to accept (docs/security.md).

Engine processes of both sides. A request is [mac, header, body]: header = the client's random id
(16 bytes) + a sequence number (8 bytes, counting up); body = msgpack of one typed message. A reply
echoes the header. With a shared secret the MAC is HMAC-SHA256 over header + body (made with the
current secret, accepted under the current or the previous one), and the server refuses a sequence
number it has already seen from that client (a replayed capture). Frames have a
maximum size (ZMQ drops the connection that sends a larger one) and messages bound their lists, so
no message can make a peer do unbounded work.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections import OrderedDict

import msgspec

MAX_REQUEST_BYTES = 1 << 20
MAX_REPLY_BYTES = 64 << 20  # a handshake reply carries agent metadata of many ranks
CLIENT_ID_BYTES = 16
HEADER_BYTES = CLIENT_ID_BYTES + 8
CLIENTS_KEPT = 4096  # replay windows remembered (least recently seen forgotten first)

_encoder = msgspec.msgpack.Encoder()


def new_client_id() -> bytes:
    return os.urandom(CLIENT_ID_BYTES)


def header(client_id: bytes, seq: int) -> bytes:
    return client_id + seq.to_bytes(8, "little")


def parse_header(raw: bytes) -> tuple[bytes, int] | None:
    if len(raw) != HEADER_BYTES:
        return None
    return raw[:CLIENT_ID_BYTES], int.from_bytes(raw[CLIENT_ID_BYTES:], "little")


def mac(secret: bytes | None, head: bytes, body: bytes) -> bytes:
    return hmac.new(secret, head + body, hashlib.sha256).digest() if secret else b""


def verify(secret: bytes | None, tag: bytes, head: bytes, body: bytes, previous: bytes | None = None) -> bool:
    """The MAC is the current secret's or, while a secret rotates, the previous one's."""
    if not secret:
        return True
    ok = hmac.compare_digest(tag, mac(secret, head, body))
    return (previous is not None and hmac.compare_digest(tag, mac(previous, head, body))) | ok


def encode_request(secret: bytes | None, client_id: bytes, seq: int, msg) -> list[bytes]:
    head = header(client_id, seq)
    body = _encoder.encode(msg)
    return [mac(secret, head, body), head, body]


def encode_reply(secret: bytes | None, head: bytes, reply) -> list[bytes]:
    body = _encoder.encode(reply)
    return [mac(secret, head, body), head, body]


class ReplayWindow:
    """The highest sequence number seen per client; a request must go above it."""

    def __init__(self, kept: int = CLIENTS_KEPT):
        self.kept = kept
        self._last: OrderedDict[bytes, int] = OrderedDict()

    def accept(self, client_id: bytes, seq: int) -> bool:
        last = self._last.get(client_id)
        if last is not None and seq <= last:
            return False
        self._last[client_id] = seq
        self._last.move_to_end(client_id)
        if len(self._last) > self.kept:
            self._last.popitem(last=False)
        return True
