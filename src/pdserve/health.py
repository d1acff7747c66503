"""What an instance tells routers about itself (`GET /health`): one typed message that the server
builds and the proxy decodes, instead of dicts read by string key.

Any process. Unknown fields are ignored when decoding, so an instance and a proxy of neighbouring
versions still understand each other; a field a router needs and an instance does not send keeps
its default.
"""

from __future__ import annotations

import msgspec


class Load(msgspec.Struct, kw_only=True):
    """Queue and KV use as of the engine's last turn (never waits for a step)."""

    num_running: int = 0
    num_waiting: int = 0  # waiting to be prefilled here
    num_waiting_for_remote_kv: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use
    num_leased_blocks: int = 0  # held for remote readers
    kv_holder: dict | None = None  # signed by the instance: where producers may claim its blocks
    prefill_tokens_per_s: float = 0.0  # measured from its steps (engine/rates.py); 0: not yet
    decode_step_s: float = 0.0  # a decode-only step's duration, measured; 0: not yet
    max_prefill_stall_s: float = 0.0  # its --max-prefill-stall-s: while streams run, a prefill here is
    # split into steps that each hold them about this long; 0: a prefill holds them for all of it


class EventEndpoints(msgspec.Struct, kw_only=True):
    """Where the instance publishes its KV events (vLLM's schema) and replays missed batches."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    encoding: str = "map"
    last_seq: int = -1


class PrefixCacheInfo(msgspec.Struct, kw_only=True):
    """How a router recomputes this instance's block hashes (prefix_cache.hashing), and its events."""

    hash_algorithm: str = ""
    hash_seed: str = ""
    model_key: str = ""
    block_size: int = 16
    enabled: bool = True
    kv_events: EventEndpoints | None = None


class Health(msgspec.Struct, kw_only=True):
    status: str = "ok"
    engine_id: str = ""  # unique per process start: a restarted instance is a new one
    load: Load = msgspec.field(default_factory=Load)
    warnings: list[str] = []
    prefix_cache: PrefixCacheInfo | None = None


_decoder = msgspec.json.Decoder(Health)


def decode_health(raw: bytes) -> Health:
    """An instance's /health body (raises msgspec.ValidationError / DecodeError on garbage)."""
    return _decoder.decode(raw)
