"""Where one request goes: the decode and prefill candidates and the conditional decision, chosen
together by predicted time to first token.

Proxy process (pure but for reading the KV index). Under `kv-aware` routing with the prompt's token
ids known, for each producer P and decode instance D (prefill rates as each measured its own steps
and reports in /health; one that has not yet counts as the mean of those that have, as instances
of a deployment are alike, and DEFAULT_TOKENS_PER_S before any has):

    TTFT(P, D) = REMOTE_OVERHEAD_S + (queue of P + prompt tokens P lacks) / P's prefill rate
                 + blocks D lacks moved over the fabric + D's queue / D's prefill rate

A producer lacks what neither its own cache nor a decode instance it can pull from holds
(kv_transfer/pull.py: worth it from PULL_MIN_TOKENS on). Prefilling on D instead ("local") costs
(D's queue + tokens D lacks) / D's rate, and is allowed only when D holds part of the prompt and the
prefill stalls D's running streams for at most STALL_BUDGET_S. Every queued request weighs as
LOAD_TOKENS prompt tokens and every stream a decode instance runs as STREAM_TOKENS, so the best
cache does not draw every request (no pile-up). Other
policies ignore caches and times (policy.py).
"""

from __future__ import annotations

import dataclasses

from pdserve.proxy.policy import LOAD_TOKENS
from pdserve.proxy.prompts import block_hashes
from pdserve.proxy.router import Router, UpstreamState

PULL_MIN_TOKENS = 64  # what a producer pulls at least (its --kv-pull-min-tokens default)
DEFAULT_TOKENS_PER_S = 1000.0  # prefill rate assumed until an instance has measured its own
TRANSFER_S_PER_BLOCK = 5e-5  # moving one block between instances (KV transfer bench: ~8 GB/s)
REMOTE_OVERHEAD_S = 0.01  # the producer's leg: a second HTTP exchange, its step, the hand-off
STALL_BUDGET_S = 0.1  # a local prefill may hold decode's running streams this long
STREAM_TOKENS = 32  # a stream a decode instance runs weighs as this many prompt tokens


@dataclasses.dataclass(frozen=True)
class Placement:
    decode: list[UpstreamState]
    prefill: list[UpstreamState]
    num_tokens: int | None = None  # the prompt's, when the proxy could tokenize it
    decode_uncached: int | None = None  # of which the first decode candidate lacks (kv-aware)
    local: bool = False  # kv-aware: prefilling on that decode instance is predicted fastest
    holders: list[UpstreamState] = dataclasses.field(default_factory=list)  # healthy decode instances a
    # producer may claim the prompt's blocks from: best cache first (kv-aware), else least loaded first


def place(router: Router, ids: list[int] | None, cache_salt=None) -> Placement:
    policy = router.policy
    n = len(ids) if ids is not None else None
    if ids is None or policy != "kv-aware" or router.index is None:  # holders: least loaded first
        holders = [s for s in sorted(router.decode.states, key=UpstreamState.score) if s.healthy]
        return Placement(router.decode.ordered(policy), router.prefill.ordered(policy), n, holders=holders)
    cached = _Cached(router, ids, cache_salt)
    measured = [s.prefill_tokens_per_s for s in router.prefill.states + router.decode.states
                if s.prefill_tokens_per_s > 0]
    typical = sum(measured) / len(measured) if measured else DEFAULT_TOKENS_PER_S  # instances are alike

    def rate(state: UpstreamState) -> float:
        return state.prefill_tokens_per_s or typical

    decodes = router.decode.states
    best_holder = max((cached(s) for s in decodes if s.healthy), default=0)

    def producer_s(p: UpstreamState) -> float:
        own = cached(p)
        have = best_holder if best_holder - own >= PULL_MIN_TOKENS else own
        return (LOAD_TOKENS * (p.outstanding + p.queued) + n - have) / rate(p)

    def decode_s(d: UpstreamState) -> float:
        lacks_blocks = -(-(n - cached(d)) // _block_size(d))
        return lacks_blocks * TRANSFER_S_PER_BLOCK + _queue_tokens(d) / rate(d)

    prefill = sorted(router.prefill.rotated(), key=lambda p: (not p.healthy, producer_s(p)))
    remote = sorted(router.decode.rotated(), key=lambda d: (not d.healthy, decode_s(d)))
    remote_s = REMOTE_OVERHEAD_S + (producer_s(prefill[0]) if prefill else float("inf")) \
        + (decode_s(remote[0]) if remote else 0)

    def local_s(d: UpstreamState) -> float:
        return (_queue_tokens(d) + n - cached(d)) / rate(d)
    local = [d for d in remote if d.healthy and 0 < cached(d) and (n - cached(d)) / rate(d) <= STALL_BUDGET_S]
    nearest = min(local, key=local_s, default=None)
    is_local = nearest is not None and local_s(nearest) <= remote_s
    first = nearest if is_local else (remote[0] if remote else None)
    decode = [first] + [d for d in remote if d is not first] if first is not None else remote
    holders = sorted((d for d in decodes if d.healthy), key=lambda d: -cached(d))
    return Placement(decode, prefill, n, n - cached(first) if first is not None else n, is_local, holders)


def _queue_tokens(d: UpstreamState) -> int:
    """A decode instance's queue in prompt tokens: prompts waiting to be prefilled there, and the
    streams it runs (each makes every step, a new request's first included, a little longer)."""
    return LOAD_TOKENS * d.prefill_queue() + STREAM_TOKENS * d.outstanding


def _block_size(state: UpstreamState) -> int:
    return state.prefix_cache.block_size if state.prefix_cache is not None else 16


class _Cached:
    """Prompt tokens an instance caches, from the index (hashed once per way of hashing)."""

    def __init__(self, router: Router, ids: list[int], cache_salt):
        self.router, self.ids, self.salt = router, ids, cache_salt
        self._hashes: dict[tuple[str, int], list[int]] = {}
        self._memo: dict[str, int] = {}

    def __call__(self, state: UpstreamState) -> int:
        if state.url not in self._memo:
            self._memo[state.url] = self._count(state)
        return self._memo[state.url]

    def _count(self, state: UpstreamState) -> int:
        info = state.prefix_cache
        if info is None or not info.enabled:
            return 0
        key = (info.model_key, info.block_size)
        if key not in self._hashes:
            self._hashes[key] = block_hashes(self.ids, info, self.salt)
        return self.router.index.cached_blocks(state.url, self._hashes[key]) * info.block_size
