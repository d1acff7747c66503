"""Producer-signed `kv_transfer_params` (docs/security.md): the consumer never dials an address or
reads a block id that the producer did not sign. Also the MAC on NIXL notifications.

Engine process. The producer signs the canonical JSON of every field it returns plus an expiry
(wall clock, seconds since the epoch: params travel between hosts) with HMAC-SHA256 under the
deployment's shared secret; the consumer checks the signature and the expiry before anything else.
The canonical form is rebuilt from the typed params, so key order or spacing on the way (proxies,
clients) does not matter and a field nobody signed cannot be added. Floats travel as the hex of
their IEEE-754 bits (`params.wire_float`): a router that parses JSON and prints its numbers again
(other digits, or a parser one ulp off) cannot change them, and 30 signs as 30.0 does. Signing uses the current secret; verifying accepts the
current or the previous one, so a secret rotates without restarting every instance at once.
"""

from __future__ import annotations

import hashlib
import hmac
import json

import msgspec

from pdserve.kv_transfer.messages import Notification
from pdserve.kv_transfer.params import FIELD, Holder, KVTransferParams
from pdserve.sampling_params import InvalidRequestError

_encoder = msgspec.msgpack.Encoder()


def canonical(params: KVTransferParams | Holder) -> bytes:
    body = params.to_json()
    body.pop("signature", None)
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def sign(params: KVTransferParams | Holder, secret: bytes) -> str:
    return hmac.new(secret, canonical(params), hashlib.sha256).hexdigest()


def verify(params: KVTransferParams | Holder, secret: bytes | None, now: float, previous: bytes | None = None,
           skew_s: float = 0.0, field: str = FIELD) -> None:
    """Raises InvalidRequestError (naming `field`'s key) unless an instance of this deployment
    signed exactly these params (or this holder) with `secret` or `previous`, and they expired no
    more than `skew_s` (the clock skew allowed between hosts) before `now`. Without a secret there
    is nothing to check."""
    if secret is None:
        return
    if not params.signature:
        raise InvalidRequestError(f"{field}.signature", "is required: this deployment signs its params")
    if not _any_match(params.signature.encode(), lambda s: sign(params, s).encode(), secret, previous):
        raise InvalidRequestError(f"{field}.signature",
                                  "does not match: the params were changed or not issued by an instance "
                                  "of this deployment")
    if params.expires_at is None:
        raise InvalidRequestError(f"{field}.expires_at", "is required: this deployment signs its params")
    late_s = now - params.expires_at
    if late_s > skew_s:
        raise InvalidRequestError(f"{field}.expires_at",
                                  f"the params expired {late_s:.1f} s ago, beyond the {skew_s:g} s allowed "
                                  "for clock skew between hosts (--kv-clock-skew-s); if the producer's "
                                  "clock differs from this host's, synchronise them (NTP)")


def _any_match(tag: bytes, expected, secret: bytes, previous: bytes | None) -> bool:
    """Constant-time against each secret (no early exit reveals which one matched)."""
    ok = hmac.compare_digest(tag, expected(secret))
    return (previous is not None and hmac.compare_digest(tag, expected(previous))) | ok


def _notification_mac(note: Notification, secret: bytes) -> bytes:
    fields = msgspec.structs.replace(note, mac=b"")
    return hmac.new(secret, b"notification|" + _encoder.encode(fields), hashlib.sha256).digest()


def sign_notification(note: Notification, secret: bytes | None) -> Notification:
    return note if secret is None else msgspec.structs.replace(note, mac=_notification_mac(note, secret))


def notification_mac_ok(note: Notification, secret: bytes | None, previous: bytes | None = None) -> bool:
    return secret is None or _any_match(note.mac, lambda s: _notification_mac(note, s), secret, previous)
