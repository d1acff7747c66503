"""Where one request goes: its decode candidates, then its prefill candidates, chosen together.

Proxy process (pure but for reading the KV index). Under `kv-aware` routing with the prompt's token
ids known, decode instances are ordered by the work the request adds there (policy.py: what each
lacks of the prompt, its queue); the first is the one a conversation's earlier turns went to,
unless its queue outweighs its cache. Producers are then ordered the same way, counting as cached
what the chosen decode instance holds when it is worth pulling from there (a producer claims those
blocks: kv_transfer/pull.py). The tokens the chosen decode instance lacks drive the conditional
decision (decision.py). Other policies ignore caches.
"""

from __future__ import annotations

import dataclasses

from pdserve.proxy.prompts import block_hashes
from pdserve.proxy.router import Router, UpstreamState

PULL_MIN_TOKENS = 64  # what a producer pulls at least (its --kv-pull-min-tokens default)


@dataclasses.dataclass(frozen=True)
class Placement:
    decode: list[UpstreamState]
    prefill: list[UpstreamState]
    num_tokens: int | None = None  # the prompt's, when the proxy could tokenize it
    decode_uncached: int | None = None  # of which the first decode candidate lacks (kv-aware)


def place(router: Router, ids: list[int] | None, cache_salt=None) -> Placement:
    policy = router.policy
    n = len(ids) if ids is not None else None
    if ids is None or policy != "kv-aware" or router.index is None:
        return Placement(router.decode.ordered(policy), router.prefill.ordered(policy), n)
    hashes: dict[tuple[str, int], list[int]] = {}  # per way of hashing (model key, block size)

    def cached(state: UpstreamState) -> int:
        info = state.prefix_cache
        if info is None or not info.enabled:
            return 0
        key = (info.model_key, info.block_size)
        if key not in hashes:
            hashes[key] = block_hashes(ids, info, cache_salt)
        return router.index.cached_blocks(state.url, hashes[key]) * info.block_size

    decode = router.decode.ordered(policy, n, cached)
    on_decode = cached(decode[0]) if decode else 0

    def producer_cached(state: UpstreamState) -> int:
        own = cached(state)
        return on_decode if on_decode - own >= PULL_MIN_TOKENS else own

    return Placement(decode, router.prefill.ordered(policy, n, producer_cached), n, n - on_decode)
