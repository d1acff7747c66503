"""Producer-signed `kv_transfer_params` (docs/security.md): the consumer never dials an address or
reads a block id that the producer did not sign. Also the MAC on NIXL notifications.

Engine process. The producer signs the canonical JSON of every field it returns plus an expiry
(wall clock, seconds since the epoch: params travel between hosts) with HMAC-SHA256 under the
deployment's shared secret; the consumer checks the signature and the expiry before anything else.
The canonical form is rebuilt from the typed params, so key order or spacing on the way (proxies,
clients) does not matter, and a field nobody signed cannot be added.
"""

from __future__ import annotations

import hashlib
import hmac
import json

import msgspec

from pdserve.kv_transfer.messages import Notification
from pdserve.kv_transfer.params import FIELD, KVTransferParams
from pdserve.sampling_params import InvalidRequestError

_encoder = msgspec.msgpack.Encoder()


def canonical(params: KVTransferParams) -> bytes:
    body = params.to_json()
    body.pop("signature", None)
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def sign(params: KVTransferParams, secret: bytes) -> str:
    return hmac.new(secret, canonical(params), hashlib.sha256).hexdigest()


def verify(params: KVTransferParams, secret: bytes | None, now: float) -> None:
    """Raises InvalidRequestError (naming the field) unless the producer signed exactly these
    params and they have not expired. Without a secret there is nothing to check."""
    if secret is None:
        return
    if not params.signature:
        raise InvalidRequestError(f"{FIELD}.signature", "is required: this deployment signs its params")
    if not hmac.compare_digest(params.signature.encode(), sign(params, secret).encode()):
        raise InvalidRequestError(f"{FIELD}.signature",
                                  "does not match: the params were changed or not issued by a producer "
                                  "of this deployment")
    if params.expires_at is None or params.expires_at < now:
        raise InvalidRequestError(f"{FIELD}.expires_at", "the params have expired")


def _notification_mac(note: Notification, secret: bytes) -> bytes:
    fields = msgspec.structs.replace(note, mac=b"")
    return hmac.new(secret, b"notification|" + _encoder.encode(fields), hashlib.sha256).digest()


def sign_notification(note: Notification, secret: bytes | None) -> Notification:
    return note if secret is None else msgspec.structs.replace(note, mac=_notification_mac(note, secret))


def notification_mac_ok(note: Notification, secret: bytes | None) -> bool:
    return secret is None or hmac.compare_digest(note.mac, _notification_mac(note, secret))
