"""`kv_transfer_params`: the per-request P/D wire (docs/design.md, "Wire"), parsed once at the edge.

Server process. Key names follow vLLM's NIXL connector (the producer's TP size travels as `tp_size`,
`producer_tp_size` inside pdserve); `null` means absent. Everything that can be checked without
talking to the producer is checked here, and each failure names the field, so a bad request is a
400 before anything is allocated.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import struct
from typing import Any

import numpy as np

from pdserve.model.parallel import check_tp_size
from pdserve.sampling_params import INT32, MAX_LOGPROBS, InvalidRequestError

FIELD = "kv_transfer_params"
MAX_TP = 1024
MAX_BLOCKS = 1 << 20
MAX_LEASE_S = 24 * 3600.0
MAX_HOLDERS = 8
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9.\-]{0,252}|[0-9A-Fa-f:.]{2,45}")  # DNS name, IPv4 or IPv6


def wire_float(value: float) -> str:
    """A float as the wire carries it: the 16 hex digits of its IEEE-754 bits (big-endian). No JSON
    encoder or parser on the way can change a string, so a signature over it survives routers
    that re-print numbers (docs/design.md, "Wire"); `_Reader.float` reads it back to the bit."""
    return struct.pack(">d", value).hex()


def prompt_hash(token_ids: list[int]) -> str:
    """Digest of the prompt token ids; the consumer refuses params whose hash differs from its prompt."""
    return hashlib.sha256(np.asarray(token_ids, dtype=np.int64).tobytes()).hexdigest()[:32]


@dataclasses.dataclass(frozen=True)
class FirstToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


@dataclasses.dataclass(frozen=True)
class Holder:
    """An instance that may cache a later turn's prompt (a decode instance that served earlier
    turns), as it signed itself (its /health offers this): where a producer may claim those blocks
    instead of computing them. The proxy hands producers the holders it knows (`kv_holders`)."""

    engine_id: str
    host: str
    port: int
    tp_size: int
    expires_at: float | None = None
    signature: str | None = None
    spare: bool = False  # the proxy's word, never signed: another instance keeps this prompt now, so
    # what this holder lends becomes its spare copy (a conversation's history moved; not in to_json)

    @classmethod
    def parse(cls, obj: Any, field: str) -> "Holder":
        if not isinstance(obj, dict):
            raise InvalidRequestError(field, f"must be an object, got {type(obj).__name__}")
        p = _Reader(obj, field)
        holder = cls(engine_id=p.str("engine_id"), host=p.host("host"), port=p.int("port", lo=1, hi=65535),
                     tp_size=p.int("tp_size", lo=1, hi=MAX_TP), expires_at=p.float("expires_at", lo=0.0, hi=1e11),
                     signature=p.hex("signature", 64), spare=p.bool("spare"))
        for name in ("engine_id", "host", "port", "tp_size"):
            if getattr(holder, name) is None:
                raise InvalidRequestError(f"{field}.{name}", "is required")
        return holder

    def to_json(self) -> dict:
        out = {"engine_id": self.engine_id, "host": self.host, "port": self.port, "tp_size": self.tp_size}
        if self.expires_at is not None:
            out["expires_at"] = wire_float(self.expires_at)
        if self.signature is not None:
            out["signature"] = self.signature
        return out


@dataclasses.dataclass(frozen=True)
class KVTransferParams:
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_block_ids: tuple[int, ...] | None = None
    remote_request_id: str | None = None
    producer_tp_size: int | None = None  # the wire's `tp_size`
    first_token: FirstToken | None = None
    prompt_hash: str | None = None
    block_hashes: tuple[str, ...] | None = None  # the producer's content hashes of the prompt's full
    # blocks (prefix_cache.hashing.wire_hash): the consumer reuses a block it holds only where they agree
    lease_s: float | None = None
    num_cached_tokens: int | None = None  # prompt tokens the producer did not compute (its prefix
    # cache, a pull): what the consumer reports as `usage.prompt_tokens_details.cached_tokens`
    expires_at: float | None = None  # wall clock: the consumer must accept the params before
    signature: str | None = None  # the producer's HMAC over every other field (signing.py)
    kv_holders: tuple[Holder, ...] = ()  # proxy -> P: instances to claim the prompt's blocks from
    spare_copy: bool = False  # proxy -> P or D: another instance keeps this prompt's KV, so the blocks
    # this one caches of it are a spare copy, reused before the rest of its cache (never signed: it
    # only orders this instance's own evictions)

    @classmethod
    def parse(cls, obj: Any) -> "KVTransferParams | None":
        """Typed params from the request's JSON object (None or {} -> None)."""
        if obj is None:
            return None
        if not isinstance(obj, dict):
            raise InvalidRequestError(FIELD, f"must be an object, got {type(obj).__name__}")
        if not obj:
            return None
        p = _Reader(obj)
        params = cls(
            do_remote_decode=p.bool("do_remote_decode"),
            do_remote_prefill=p.bool("do_remote_prefill"),
            remote_engine_id=p.str("remote_engine_id"),
            remote_host=p.host("remote_host"),
            remote_port=p.int("remote_port", lo=1, hi=65535),
            remote_block_ids=p.int_list("remote_block_ids"),
            remote_request_id=p.str("remote_request_id"),
            producer_tp_size=p.int("tp_size", lo=1, hi=MAX_TP),
            first_token=p.first_token(),
            prompt_hash=p.str("prompt_hash"),
            block_hashes=p.hex_list("block_hashes", 16),
            lease_s=p.float("lease_s", lo=0.0, hi=MAX_LEASE_S),
            num_cached_tokens=p.int("num_cached_tokens", lo=0, hi=INT32),
            expires_at=p.float("expires_at", lo=0.0, hi=1e11),
            signature=p.hex("signature", 64),
            kv_holders=p.holders("kv_holders"),
            spare_copy=p.bool("spare_copy"),
        )
        if params.do_remote_decode and params.do_remote_prefill:
            raise InvalidRequestError(f"{FIELD}.do_remote_prefill",
                                      "cannot be set together with do_remote_decode")
        if params.do_remote_prefill:
            for name, value in (("remote_engine_id", params.remote_engine_id),
                                ("remote_host", params.remote_host), ("remote_port", params.remote_port),
                                ("remote_block_ids", params.remote_block_ids),
                                ("remote_request_id", params.remote_request_id),
                                ("tp_size", params.producer_tp_size),
                                ("first_token_id", params.first_token),
                                ("prompt_hash", params.prompt_hash)):
                if value is None:
                    raise InvalidRequestError(f"{FIELD}.{name}", "is required with do_remote_prefill")
        return params

    def check_against(self, prompt_token_ids: list[int], block_size: int, local_tp: int,
                      num_heads: int, num_kv_heads: int, vocab_size: int) -> None:
        """Consumer-side checks that need the prompt and the local geometry (still before allocation)."""
        if not self.do_remote_prefill:
            return
        expected = -(-len(prompt_token_ids) // block_size)
        if len(self.remote_block_ids) != expected:
            raise InvalidRequestError(
                f"{FIELD}.remote_block_ids",
                f"has {len(self.remote_block_ids)} blocks but the prompt of {len(prompt_token_ids)} "
                f"tokens needs {expected} blocks of {block_size} tokens")
        if self.block_hashes is not None and len(self.block_hashes) != len(prompt_token_ids) // block_size:
            raise InvalidRequestError(
                f"{FIELD}.block_hashes",
                f"has {len(self.block_hashes)} hashes but the prompt of {len(prompt_token_ids)} tokens has "
                f"{len(prompt_token_ids) // block_size} full blocks of {block_size} tokens")
        if self.num_cached_tokens is not None and self.num_cached_tokens > len(prompt_token_ids):
            raise InvalidRequestError(f"{FIELD}.num_cached_tokens",
                                      f"{self.num_cached_tokens} is more than the prompt's {len(prompt_token_ids)} tokens")
        if self.prompt_hash is not None and self.prompt_hash != prompt_hash(prompt_token_ids):
            raise InvalidRequestError(f"{FIELD}.prompt_hash",
                                      "does not match this request's prompt tokens")
        try:
            check_tp_size(self.producer_tp_size, num_heads, num_kv_heads)
        except ValueError as e:
            raise InvalidRequestError(f"{FIELD}.tp_size",
                                      f"producer tp_size={self.producer_tp_size} cannot map onto this model "
                                      f"(local tp_size={local_tp}): {e}") from None
        if not 0 <= self.first_token.token_id < vocab_size:
            raise InvalidRequestError(f"{FIELD}.first_token_id",
                                      f"{self.first_token.token_id} is outside the vocabulary")

    def lease_digest(self) -> str:
        """What a heartbeat shows of these params: the producer's lease answers only to the params
        it was issued with (its request id, blocks and prompt)."""
        raw = f"{self.remote_request_id}|{','.join(map(str, self.remote_block_ids))}|{self.prompt_hash}"
        return hashlib.sha256(raw.encode()).hexdigest()[:32]

    def to_json(self) -> dict:
        """The producer's answer, JSON-ready (vLLM's key names)."""
        out = {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_engine_id": self.remote_engine_id,
            "remote_host": self.remote_host,
            "remote_port": self.remote_port,
            "remote_block_ids": list(self.remote_block_ids),
            "remote_request_id": self.remote_request_id,
            "tp_size": self.producer_tp_size,
            "first_token_id": self.first_token.token_id,
            "prompt_hash": self.prompt_hash,
            "lease_s": None if self.lease_s is None else wire_float(self.lease_s),
        }
        if self.block_hashes is not None:
            out["block_hashes"] = list(self.block_hashes)
        if self.num_cached_tokens is not None:
            out["num_cached_tokens"] = self.num_cached_tokens
        if self.first_token.logprob is not None:
            out["first_token_logprob"] = wire_float(self.first_token.logprob)
        if self.first_token.top_logprobs is not None:
            out["first_token_top_logprobs"] = [[t, wire_float(lp)] for t, lp in self.first_token.top_logprobs]
        if self.expires_at is not None:
            out["expires_at"] = wire_float(self.expires_at)
        if self.signature is not None:
            out["signature"] = self.signature
        return out


class _Reader:
    """Typed access to the JSON object; every error names `kv_transfer_params.<key>`."""

    def __init__(self, obj: dict, field: str = FIELD):
        self.obj = obj
        self.field = field

    def _get(self, key: str, types: tuple, what: str):
        value = self.obj.get(key)
        if value is None:
            return None
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            raise InvalidRequestError(f"{self.field}.{key}", f"must be {what}, got {value!r}")
        return value

    def holders(self, key: str) -> tuple[Holder, ...]:
        value = self._get(key, (list,), "a list of holders")
        if value is None:
            return ()
        if len(value) > MAX_HOLDERS:
            raise InvalidRequestError(f"{self.field}.{key}", f"must hold at most {MAX_HOLDERS} holders")
        return tuple(Holder.parse(v, f"{self.field}.{key}[{i}]") for i, v in enumerate(value))

    def bool(self, key: str) -> bool:
        return bool(self._get(key, (bool,), "a boolean"))

    def str(self, key: str) -> str | None:
        value = self._get(key, (str,), "a string")
        if value is not None and not 0 < len(value) <= 256:
            raise InvalidRequestError(f"{self.field}.{key}", "must be 1 to 256 characters")
        return value

    def hex(self, key: str, length: int) -> str | None:
        value = self.str(key)
        if value is not None and (len(value) != length or any(c not in "0123456789abcdef" for c in value)):
            raise InvalidRequestError(f"{self.field}.{key}", f"must be {length} lowercase hex digits")
        return value

    def hex_list(self, key: str, length: int) -> tuple[str, ...] | None:
        value = self._get(key, (list,), "a list of hashes")
        if value is None:
            return None
        if len(value) > MAX_BLOCKS or any(not isinstance(v, str) or len(v) != length
                                          or any(c not in "0123456789abcdef" for c in v) for v in value):
            raise InvalidRequestError(f"{self.field}.{key}",
                                      f"must be at most {MAX_BLOCKS} strings of {length} lowercase hex digits")
        return tuple(value)

    def host(self, key: str) -> str | None:
        value = self.str(key)
        if value is not None and not _HOST.fullmatch(value):
            raise InvalidRequestError(f"{self.field}.{key}", f"is not a host name or address: {value!r}")
        return value

    def int(self, key: str, lo: int | None = None, hi: int | None = None) -> int | None:
        value = self._get(key, (int,), "an integer")
        if value is not None and (lo is not None and value < lo or hi is not None and value > hi):
            raise InvalidRequestError(f"{self.field}.{key}", f"out of range: {value}")
        return value

    def float(self, key: str, lo: float = -math.inf, hi: float = math.inf) -> float | None:
        """A number, or the 16 hex digits of its IEEE-754 bits (`wire_float`, what producers send)."""
        value = _number(self._get(key, (int, float, str), "a number"), f"{self.field}.{key}")
        if value is not None and not lo < value <= hi:
            raise InvalidRequestError(f"{self.field}.{key}", f"must be in ({lo}, {hi}], got {value}")
        return value

    def int_list(self, key: str) -> tuple[int, ...] | None:
        value = self._get(key, (list,), "a list of block ids")
        if value is None:
            return None
        if any(isinstance(v, bool) or not isinstance(v, int) for v in value):
            raise InvalidRequestError(f"{self.field}.{key}", "must contain only integers")
        if any(not 0 <= v <= INT32 for v in value):
            raise InvalidRequestError(f"{self.field}.{key}", f"block ids must be in [0, {INT32}]")
        if not 0 < len(value) <= MAX_BLOCKS:
            raise InvalidRequestError(f"{self.field}.{key}", f"must hold 1 to {MAX_BLOCKS} block ids")
        return tuple(value)

    def first_token(self) -> FirstToken | None:
        token_id = self.int("first_token_id", lo=0, hi=INT32)
        if token_id is None:
            return None
        logprob = self.float("first_token_logprob")
        top = self._get("first_token_top_logprobs", (list,), "a list of [token id, logprob] pairs")
        if top is not None:
            try:
                top = tuple((int(t), _number(lp, f"{FIELD}.first_token_top_logprobs")) for t, lp in top)
            except (TypeError, ValueError):
                raise InvalidRequestError(f"{FIELD}.first_token_top_logprobs",
                                          "must be a list of [token id, logprob] pairs") from None
            if len(top) > MAX_LOGPROBS or any(not 0 <= t <= INT32 or not math.isfinite(lp) for t, lp in top):
                raise InvalidRequestError(f"{FIELD}.first_token_top_logprobs",
                                          f"must hold at most {MAX_LOGPROBS} pairs of a token id and a "
                                          "finite logprob")
        return FirstToken(token_id, logprob, top)


def _number(value, field: str) -> float | None:
    """A JSON number or `wire_float`'s hex digits, as a finite float (None stays None)."""
    if value is None:
        return None
    if isinstance(value, str):
        if len(value) != 16 or any(c not in "0123456789abcdef" for c in value):
            raise InvalidRequestError(field, "must be a number or the 16 lowercase hex digits of its "
                                             f"IEEE-754 bits, got {value!r}")
        value = struct.unpack(">d", bytes.fromhex(value))[0]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(field, f"must be a number, got {value!r}")
    try:
        value = float(value)
    except OverflowError:  # an int beyond any float
        value = math.inf
    if not math.isfinite(value):
        raise InvalidRequestError(field, "must be finite")
    return value
