"""Configuration of one pdserve instance, as frozen dataclasses validated on construction.

Built once by the CLI (the only place that reads the environment) or by `pdserve.LLM`; passed down
to the engine, the TP ranks (pickled) and the connector. Values discovered at run time (the number
of KV blocks, bytes per block) live in `worker.kv_cache.CacheLayout`, not here.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{field}: {message}")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # fixed block count; wins over kv_cache_gib
    kv_cache_gib: float = 1.0  # per TP rank
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # vLLM's spelling; auto = the model's dtype (model/kv_dtype.py)

    def __post_init__(self):
        _check(self.kv_cache_dtype in ("auto", "float32", "bfloat16", "float16", "fp8_e4m3", "fp8"),
               "kv_cache_dtype", f"must be auto, float32, bfloat16, float16 or fp8_e4m3, got {self.kv_cache_dtype!r}")
        _check(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
               "block_size", f"must be a power of two, got {self.block_size}")
        _check(self.num_blocks is None or self.num_blocks >= 2, "num_blocks",
               f"must be at least 2, got {self.num_blocks}")
        _check(self.kv_cache_gib > 0, "kv_cache_gib", f"must be positive, got {self.kv_cache_gib}")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # token budget of one step
    enable_chunked_prefill: bool = True
    kv_pull_min_tokens: int = 64  # a producer pulls uncached prompt blocks from a holder from this many
    # tokens on (fewer are computed: a pull's round trips cost more); 0 never pulls
    max_prefill_stall_s: float = 0.0  # while streams run, a step prefills at most what this instance
    # prefills in this long (its measured rate): a prompt prefilled here delays each stream's next
    # token about this much per step, however long it is; 0: the token budget alone

    def __post_init__(self):
        _check(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        _check(self.max_prefill_stall_s >= 0, "max_prefill_stall_s",
               f"must be >= 0, got {self.max_prefill_stall_s}")
        _check(self.kv_pull_min_tokens >= 0, "kv_pull_min_tokens", f"must be >= 0, got {self.kv_pull_min_tokens}")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
               f"must be >= 1, got {self.max_num_batched_tokens}")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    dist_host: str = "127.0.0.1"  # where rank 0 binds the gloo store (port 0, reported to ranks)
    dist_timeout_s: float = 60.0
    step_timeout_s: float = 600.0  # a rank that has not answered a step by then is declared dead
    # Cores each rank is pinned to (rank -> cpus); empty = no pinning.
    rank_cpus: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self):
        _check(self.tensor_parallel_size >= 1, "tensor_parallel_size",
               f"must be >= 1, got {self.tensor_parallel_size}")
        _check(not self.rank_cpus or len(self.rank_cpus) == self.tensor_parallel_size, "rank_cpus",
               "needs one cpu set per rank")


FAILURE_POLICIES = ("fail", "recompute")
MAX_CLOCK_SKEW_S = 300.0  # beyond that the hosts' clocks need fixing, not a larger allowance


@dataclasses.dataclass(frozen=True)
class KVTransferConfig:
    """The P/D connector. Every address a peer uses comes from here (multi-host ready)."""

    side_channel_host: str = "127.0.0.1"  # bind address of the ZMQ listener
    side_channel_port: int = 0  # 0 = any free port, the bound one is advertised
    advertised_host: str | None = None  # what consumers dial; defaults to side_channel_host
    lease_s: float = 30.0
    handshake_timeout_s: float = 10.0
    transfer_timeout_s: float = 30.0
    failure_policy: str = "fail"
    secret: bytes | None = None  # signs params, side-channel frames and notifications
    previous_secret: bytes | None = None  # also accepted (never used to sign): rotation without a restart
    clock_skew_s: float = 5.0  # how long after their expiry signed params are still accepted (hosts' clocks)
    backend: str = "UCX"
    copy_lanes: int = 1  # NIXL agents (one thread each) a consumer rank splits large READs across
    producers: tuple[str, ...] = ()  # "host:port" side channels a consumer may dial (empty: any signed)
    allow_insecure: bool = False  # a side channel off loopback without a secret (warned)

    def __post_init__(self):
        _check(self.secret is not None or self.allow_insecure or is_loopback(self.side_channel_host),
               "side_channel_host",
               f"{self.side_channel_host} is reachable from other hosts but no shared secret is set "
               "(PDSERVE_KV_SECRET); anyone reaching it could read this instance's KV cache. Set a "
               "secret, or pass --allow-insecure-side-channel")
        _check(self.previous_secret is None or self.secret is not None, "previous_secret",
               "needs a current secret (PDSERVE_KV_SECRET) too")
        _check(0 <= self.clock_skew_s <= MAX_CLOCK_SKEW_S, "kv_clock_skew_s",
               f"must be in [0, {MAX_CLOCK_SKEW_S:g}] s, got {self.clock_skew_s}")
        _check(self.copy_lanes >= 1, "kv_copy_lanes", f"must be at least 1, got {self.copy_lanes}")
        _check(self.failure_policy in FAILURE_POLICIES, "kv_load_failure_policy",
               f"must be one of {FAILURE_POLICIES}, got {self.failure_policy!r}")
        for name in ("lease_s", "handshake_timeout_s", "transfer_timeout_s"):
            _check(getattr(self, name) > 0, name, f"must be positive, got {getattr(self, name)}")
        _check(0 <= self.side_channel_port < 65536, "side_channel_port",
               f"out of range: {self.side_channel_port}")

    @property
    def advertise(self) -> str:
        host = self.advertised_host or self.side_channel_host
        _check(host not in ("0.0.0.0", "::"), "advertised_host",
               "must be set when the side channel binds to a wildcard address")
        return host


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """`--kv-events-config`, vLLM's keys (docs/design.md, "Prefix cache: hashes and KV events").
    An endpoint binds when it has `*` or `::`, is ipc/inproc, or names port 0; otherwise it
    connects (vLLM's rule). `encoding` and `role` are pdserve's."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: "zmq" when enabled
    endpoint: str = "tcp://127.0.0.1:0"  # loopback, any free port (reported by /health)
    replay_endpoint: str | None = None  # a ROUTER socket serving past batches
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # events waiting to be sent; beyond it they are dropped (a gap)
    topic: str = ""  # empty: "kv@<role>@<engine id>"
    encoding: str = "map"  # "map" (events tagged with "type") or "array" (vLLM's older form)
    role: str = "both"  # named in the default topic, e.g. "prefill" or "decode"

    def __post_init__(self):
        _check(isinstance(self.enable_kv_cache_events, bool), "kv_events_config.enable_kv_cache_events",
               "must be true or false")
        _check(self.publisher in (None, "zmq", "null"), "kv_events_config.publisher",
               f"must be zmq or null, got {self.publisher!r}")
        _check(self.encoding in ("map", "array"), "kv_events_config.encoding",
               f"must be map or array, got {self.encoding!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            v = getattr(self, name)
            _check(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"kv_events_config.{name}",
                   f"must be an integer >= 1, got {v!r}")
        for name in ("endpoint", "topic", "role"):
            _check(isinstance(getattr(self, name), str), f"kv_events_config.{name}", "must be a string")
        _check(self.replay_endpoint is None or isinstance(self.replay_endpoint, str),
               "kv_events_config.replay_endpoint", "must be a string")
        _check(self.endpoint.startswith(("tcp://", "ipc://", "inproc://")), "kv_events_config.endpoint",
               f"must be a tcp://, ipc:// or inproc:// address, got {self.endpoint!r}")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def from_json(cls, text: str) -> "KVEventsConfig":
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"kv_events_config: not JSON: {e}") from None
        _check(isinstance(raw, dict), "kv_events_config", "must be a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - names)
        _check(not unknown, "kv_events_config", f"unknown keys {unknown}; known: {sorted(names)}")
        try:
            return cls(**raw)
        except TypeError as e:
            raise ConfigError(f"kv_events_config: {e}") from None


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"
    quantization: str | None = None  # weights: none, int8, int4; None = the checkpoint's own (GGUF's)
    seed: int = 0
    max_model_len: int | None = None  # defaults to the checkpoint's context
    num_threads: int | None = None  # torch threads per rank; None = cores available / TP size
    chat_template: str | None = None  # a file or template text that wins over the checkpoint's
    mock_engine: bool = False  # no weights: steps sleep as long as the real ones (worker/mock_runner.py)
    mock_speedup: float = 1.0  # ... divided by this
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    kv_transfer: KVTransferConfig | None = None
    kv_events: KVEventsConfig = dataclasses.field(default_factory=KVEventsConfig)

    def __post_init__(self):
        _check(self.mock_speedup > 0, "mock_speedup", f"must be positive, got {self.mock_speedup}")
        _check(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype",
               f"must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        _check(self.quantization in (None, "none", "int8", "int4"), "quantization",
               f"must be none, int8 or int4, got {self.quantization!r}")
        _check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len",
               f"must be >= 2, got {self.max_model_len}")
        _check(self.num_threads is None or self.num_threads >= 1, "num_threads",
               f"must be >= 1, got {self.num_threads}")

    def threads_per_rank(self) -> int:
        if self.num_threads is not None:
            return self.num_threads
        return max(1, len(os.sched_getaffinity(0)) // self.parallel.tensor_parallel_size)


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0 = any free port (the bound one is printed and written to port_file)
    served_model_name: str | None = None  # defaults to the model directory's name
    api_key: str | None = None
    max_pending: int = 1024  # in-flight HTTP requests before 503
    max_request_body_bytes: int = 8 << 20  # larger bodies get a 413
    shutdown_timeout_s: float = 10.0  # in-flight HTTP requests finish within this after SIGTERM
    drain_timeout_s: float = 60.0  # then leases and KV loads end within this before the engine stops
    port_file: str | None = None
    enable_debug_endpoints: bool = False  # tests only: KV checksums, loaded peers
    generation_config: str = "auto"  # "auto": the checkpoint's sampling defaults; "vllm": pdserve's
    trust_request_chat_template: bool = False  # render templates requests bring (sandboxed, bounded)
    enable_auto_tool_choice: bool = False  # vLLM's: tool_choice "auto" reads calls with the parser below
    tool_call_parser: str | None = None  # hermes, llama3_json, mistral (text/tool_parsers.py)

    def __post_init__(self):
        _check(0 <= self.port < 65536, "port", f"out of range: {self.port}")
        _check(self.max_pending >= 1, "max_pending", f"must be >= 1, got {self.max_pending}")


@dataclasses.dataclass(frozen=True)
class ProxyConfig:
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # what clients must present to the proxy
    upstream_api_key: str | None = None  # what the proxy presents to the instances
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 600.0
    port_file: str | None = None
    upstream_protocol: str = "auto"  # pdserve or vllm instances (auto: ask them)
    max_request_body_bytes: int = 8 << 20  # larger bodies get a 413
    probe_interval_s: float = 1.0  # how often each instance's /health (and load) is asked
    max_wait_s: float = 30.0  # how long a request waits while every producer is busy (then 503)
    local_prefill_max_tokens: int = 0  # conditional disaggregation: shorter prompts may prefill on decode
    local_prefill_max_queue: int = 2  # ... while decode has at most this many waiting
    admin_key: str | None = None  # enables PUT /admin/upstreams (a cluster registers its instances)
    routing: str = "kv-aware"  # round-robin, least-loaded or kv-aware (proxy/policy.py)
    tokenizer: str | None = None  # the model's checkpoint: prompts are tokenized to route by their blocks
    chat_template: str | None = None  # the instances' --chat-template, rendered as they render it
    kv_events_drop_fraction: float = 0.0  # benchmarks only: the KV index loses this share of batches
    kv_events_drop_seed: int = 0
    kv_copies: str = "one"  # kv-aware: a disaggregated prompt's KV kept in one pool (proxy/copies.py) or both
    placement_log: str | None = None  # a file: one JSON line per tokenized request, where it was placed

    def __post_init__(self):
        _check(0.0 <= self.kv_events_drop_fraction < 1.0, "kv_events_drop_fraction",
               f"must be in [0, 1), got {self.kv_events_drop_fraction}")
        _check(self.routing in ("round-robin", "least-loaded", "kv-aware"), "routing",
               f"must be round-robin, least-loaded or kv-aware, got {self.routing!r}")
        _check(self.kv_copies in ("one", "both"), "kv_copies", f"must be one or both, got {self.kv_copies!r}")
        _check(self.upstream_protocol in ("auto", "pdserve", "vllm"), "upstream_protocol",
               f"must be auto, pdserve or vllm, got {self.upstream_protocol!r}")
        _check(len(self.decode_urls) >= 1 or self.admin_key is not None, "decode",
               "needs at least one decode URL (or an admin key: instances registered later)")
        for url in (*self.prefill_urls, *self.decode_urls):
            _check(url.startswith(("http://", "https://")), "prefill/decode",
                   f"URL must start with http:// or https://, got {url!r}")
