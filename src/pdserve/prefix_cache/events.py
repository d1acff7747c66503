"""KV events in vLLM's schema: what an instance says about its prefix cache, and their encodings.

Any process: the engine's publisher encodes, subscribers decode. A batch is
`EventBatch{ts, events, data_parallel_rank}`; events are `BlockStored`, `BlockRemoved` and
`AllBlocksCleared`. Two encodings (msgpack): "map" (the default, vLLM since June 2026: each event a
map tagged `"type": "BlockStored"`) and "array" (vLLM's older positional form: a batch is
`[ts, events, data_parallel_rank]`, an event `["BlockStored", field, field, ...]`). `decode_batch`
accepts both, at both levels. Hashes are `hashing.event_hash` integers.
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM = "cpu"  # pdserve's KV cache lives in host memory
ENCODINGS = ("map", "array")


class KVCacheEvent(msgspec.Struct, tag=True):
    """Base of the events; the tag (`type`) is the class name."""


class BlockStored(KVCacheEvent):
    """Consecutive blocks of one request entered the prefix cache. `token_ids` holds
    `block_size` tokens per hash; `parent_block_hash` is the content parent of the first (None for a
    prompt's first block); `extra_keys` holds, per block, the extra keys hashed with it (model key,
    then `cache_salt` if any), so a subscriber can recompute every hash."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM
    lora_name: str | None = None
    extra_keys: list[list[str] | None] | None = None


class BlockRemoved(KVCacheEvent):
    """The instance no longer holds any block with these hashes."""

    block_hashes: list[int]
    medium: str | None = MEDIUM


class AllBlocksCleared(KVCacheEvent):
    """The prefix cache was reset: nothing is cached any more."""


Event = BlockStored | BlockRemoved | AllBlocksCleared
_EVENT_TYPES = {cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}


class EventBatch(msgspec.Struct):
    ts: float  # wall-clock seconds when the batch was sealed
    events: list[Event]
    data_parallel_rank: int | None = None


class Snapshot(msgspec.Struct):
    """Every block an instance caches, consistent with the event stream up to batch `seq` (-1: no
    batch yet): a subscriber that lost events clears, applies `blocks`, then batches after `seq`."""

    seq: int
    topic: str
    blocks: list[BlockStored]


_encoder = msgspec.msgpack.Encoder()


def encode_batch(batch: EventBatch, encoding: str = "map") -> bytes:
    if encoding == "map":
        return _encoder.encode(batch)
    if encoding != "array":
        raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
    events = [[type(e).__name__, *msgspec.structs.astuple(e)] for e in batch.events]
    return _encoder.encode([batch.ts, events, batch.data_parallel_rank])


def decode_batch(payload: bytes) -> EventBatch:
    """A batch in either encoding. Unknown event types are skipped; missing trailing fields take
    their defaults; unknown fields are ignored (publishers append fields over time)."""
    raw = msgspec.msgpack.decode(payload)
    if isinstance(raw, dict):
        ts, events, rank = raw["ts"], raw.get("events", []), raw.get("data_parallel_rank")
    else:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    decoded = [e for e in map(_decode_event, events) if e is not None]
    return EventBatch(ts=float(ts), events=decoded, data_parallel_rank=rank)


def _decode_event(raw: Any) -> Event | None:
    if isinstance(raw, dict):
        cls = _EVENT_TYPES.get(raw.get("type"))
        fields = {k: v for k, v in raw.items() if k != "type"}
    else:
        cls = _EVENT_TYPES.get(raw[0]) if raw else None
        fields = dict(zip(cls.__struct_fields__, raw[1:])) if cls else {}
    if cls is None:
        return None
    fields = {k: v for k, v in fields.items() if k in cls.__struct_fields__}
    return msgspec.convert(fields, cls)
