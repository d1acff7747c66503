"""Where one request goes: the decode and prefill candidates and the conditional decision, chosen
together by predicted time to first token.

Proxy process (pure but for reading the KV index). Under `kv-aware` routing with the prompt's token
ids known, for each producer P and decode instance D (prefill rates as each measured its own steps
and reports in /health; the median of those measured for one within ALIKE of it or not measured yet,
as instances of a deployment are alike but for noise, and DEFAULT_TOKENS_PER_S before any is):

    TTFT(P, D) = REMOTE_OVERHEAD_S + (queue of P + prompt tokens P lacks) / P's prefill rate
                 + blocks D lacks moved over the fabric + D's queue / D's prefill rate

A producer lacks what neither its own cache nor another instance it can pull from holds
(kv_transfer/pull.py: worth it from PULL_MIN_TOKENS on), and a claim from a decode instance waits
for the end of that instance's step (its measured decode step): producers claim from each other as
from decode, so the one with the best cache draws no more requests than the others. Prefilling on
D instead ("local") costs (D's queue + tokens D lacks) / D's rate, where D too claims what another
instance holds. A decode instance started with --max-prefill-stall-s (as `pdserve up` starts them)
splits a prefill beside its streams into steps that each hold them about that long; each step past
the first also decodes them, and the request waits for it. Going local is allowed when D holds part
of the prompt and the prefill holds D's running streams at most STALL_BUDGET_S at once and
STALL_MAX_S all told; or, while every producer has work, for any prompt when D runs no stream (an
idle decode instance is then a spare producer, taking work off the producers' queues with no
stream's inter-token latency paying for it), or when it holds them at most STALL_MAX_S all told
and going local saves the request more time than they lose together (the stall times the streams).
(While a producer is idle, turns stay with producers, whose caches then keep half the histories:
copies.py.) Every queued request weighs as LOAD_TOKENS prompt tokens and every stream a decode
instance runs as STREAM_TOKENS, so the best cache does not draw every request (no pile-up). Other
policies ignore caches and times (policy.py).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

from pdserve.proxy.policy import LOAD_TOKENS
from pdserve.proxy.prompts import block_hashes
from pdserve.proxy.router import Router, UpstreamState

PULL_MIN_TOKENS = 64  # what a producer pulls at least (its --kv-pull-min-tokens default)
DEFAULT_TOKENS_PER_S = 1000.0  # prefill rate assumed until an instance has measured its own
TRANSFER_S_PER_BLOCK = 5e-5  # moving one block between instances (KV transfer bench: ~8 GB/s)
REMOTE_OVERHEAD_S = 0.01  # the producer's leg: a second HTTP exchange, its step, the hand-off
STALL_BUDGET_S = 0.1  # a local prefill may hold decode's running streams this long at once
STALL_MAX_S = 0.25  # ... and this long all told (also when the request's wait for a producer exceeds
# what its streams lose)
STREAM_TOKENS = 32  # a stream a decode instance runs weighs as this many prompt tokens
ALIKE = 2.0  # measured prefill rates within this factor of the median are noise: the median is used
NEAR, NEAR_S = 0.1, 0.002  # predicted times within 10 % + 2 ms of the fastest count as equal
COMPUTING_S = 1.0  # a prompt placed on an instance counts as cached there this long past its predicted
# prefill; by then the instance's KV events have told the index what it caches


@dataclasses.dataclass(frozen=True)
class Placement:
    decode: list[UpstreamState]
    prefill: list[UpstreamState]
    num_tokens: int | None = None  # the prompt's, when the proxy could tokenize it
    decode_uncached: int | None = None  # of which the first decode candidate lacks (kv-aware)
    local: bool = False  # kv-aware: prefilling on that decode instance is predicted fastest
    holders: list[UpstreamState] = dataclasses.field(default_factory=list)  # healthy instances the instance
    # prefilling may claim the prompt's blocks from: any caching some, best first, but the chosen producer,
    # or the decode instance when local (kv-aware); else decode instances, least loaded first
    block_hashes: list[int] = dataclasses.field(default_factory=list)  # kv-aware: the prompt's full
    # blocks as the first decode candidate hashes them (what copies.py remembers a conversation by)
    cached_anywhere: int | None = None  # kv-aware: the most prompt tokens any one instance holds (index)
    held: dict[str, int] = dataclasses.field(default_factory=dict)  # kv-aware: each healthy instance's, by URL
    predicted: dict[str, object] = dataclasses.field(default_factory=dict)  # kv-aware: seconds to the first
    # token on the best remote pair and on the best decode instance allowed to prefill, each decode
    # instance's stall, and the prefill rate used for each instance (tokens/s): what the decision was
    # made from (--placement-log)


def place(router: Router, ids: list[int] | None, cache_salt=None, now: float | None = None) -> Placement:
    policy = router.policy
    n = len(ids) if ids is not None else None
    if ids is None or policy != "kv-aware" or router.index is None:  # holders: least loaded first
        holders = [s for s in sorted(router.decode.states, key=UpstreamState.score) if s.healthy]
        return Placement(router.decode.ordered(policy), router.prefill.ordered(policy), n, holders=holders)
    now = time.monotonic() if now is None else now
    cached = _Cached(router, ids, cache_salt, now)
    measured = [s.prefill_tokens_per_s for s in router.prefill.states + router.decode.states
                if s.prefill_tokens_per_s > 0]
    typical = statistics.median(measured) if measured else DEFAULT_TOKENS_PER_S  # instances are alike

    def rate(state: UpstreamState) -> float:  # alike instances measure alike rates, but for noise
        r = state.prefill_tokens_per_s
        return r if r and not typical / ALIKE <= r <= typical * ALIKE else typical

    decodes = router.decode.states
    caches = [s for s in router.prefill.states + decodes if s.healthy]  # where a producer may pull from

    def holder(p: UpstreamState) -> UpstreamState | None:  # the other instance caching most: p may claim it there
        return max((s for s in caches if s is not p), key=cached.held, default=None)

    def claims(s: UpstreamState) -> UpstreamState | None:  # the holder s pulls from rather than computing
        h = holder(s)
        return h if h is not None and cached.held(h) - cached(s) >= PULL_MIN_TOKENS else None

    def have(s: UpstreamState) -> int:  # what s need not compute: its own, or what it may claim elsewhere
        h = claims(s)
        return cached.held(h) if h is not None else cached(s)

    def claim_s(s: UpstreamState) -> float:  # a holder grants a claim at the end of its step
        h = claims(s)
        return h.decode_step_s if h is not None else 0.0

    def producer_s(p: UpstreamState) -> float:
        return (LOAD_TOKENS * (p.outstanding + p.queued) + n - have(p)) / rate(p) + claim_s(p)

    def decode_s(d: UpstreamState) -> float:
        lacks_blocks = -(-(n - cached(d)) // _block_size(d))
        return lacks_blocks * TRANSFER_S_PER_BLOCK + _queue_tokens(d) / rate(d)

    prefill = _ranked(router.prefill.rotated(), producer_s, cached)
    remote = _ranked(router.decode.rotated(), decode_s, cached)
    remote_s = REMOTE_OVERHEAD_S + (producer_s(prefill[0]) if prefill else float("inf")) \
        + (decode_s(remote[0]) if remote else 0)

    def stall_s(d: UpstreamState) -> float:  # how long a local prefill holds d's running streams, all told
        return (n - have(d)) / rate(d)

    def gap_s(d: UpstreamState) -> float:  # ... at most at once: d splits it into steps while it runs streams
        split = d.max_prefill_stall_s if d.streams() else 0.0
        return min(stall_s(d), split) if split > 0 else stall_s(d)

    def local_s(d: UpstreamState) -> float:  # each step past the first also decodes d's streams
        stall, gap = stall_s(d), gap_s(d)
        steps = math.ceil(stall / gap - 1e-9) if gap > 0 else 1
        return _queue_tokens(d) / rate(d) + claim_s(d) + stall + (steps - 1) * d.decode_step_s
    producers_busy = router.prefill.least_queued() > 0  # every healthy producer has a request in flight or queued

    def may_prefill(d: UpstreamState) -> bool:  # the stall its streams would pay is worth it
        stall, gap = stall_s(d), gap_s(d)
        return 0 < cached(d) and gap <= STALL_BUDGET_S and stall <= STALL_MAX_S or producers_busy and (
            d.streams() == 0 or stall <= STALL_MAX_S and stall * d.streams() <= remote_s - local_s(d))
    local = [d for d in remote if d.healthy and may_prefill(d)]
    nearest = min(local, key=local_s, default=None)
    is_local = nearest is not None and local_s(nearest) <= remote_s
    first = nearest if is_local else (remote[0] if remote else None)
    decode = [first] + [d for d in remote if d is not first] if first is not None else remote
    computer = first if is_local else (prefill[0] if prefill else None)
    holders = sorted((s for s in caches if cached.held(s) and s is not computer), key=lambda s: -cached.held(s))
    if computer is not None:  # siblings that follow soon find the prompt there (before the index does)
        cached.computing(computer, now + COMPUTING_S + (local_s(computer) if is_local else producer_s(computer)))
    hashes = cached.of(first) if first is not None else []
    held = {s.url: cached.held(s) for s in caches}
    predicted = {"remote_s": round(remote_s, 4), "local_s": round(local_s(nearest), 4) if nearest else None,
                 "stall_s": {d.url: round(stall_s(d), 4) for d in remote},
                 "rates": {s.url: round(rate(s)) for s in caches}}
    return Placement(decode, prefill, n, n - cached(first) if first is not None else n, is_local, holders, hashes,
                     max(held.values(), default=0), held, predicted)


def _ranked(rotated: list[UpstreamState], seconds, cached) -> list[UpstreamState]:
    """Healthy first, fastest first; those within NEAR of the fastest count as equal (rates measured
    on alike instances differ by noise: the fastest-measured must not draw all): the one caching
    most of the prompt first, so that a history stays where it is rather than being copied to
    another instance that then keeps it too; equals take turns."""
    ranked = sorted(rotated, key=lambda s: (not s.healthy, seconds(s)))
    if not ranked or not ranked[0].healthy:
        return ranked
    best = seconds(ranked[0])
    near = sorted((s for s in rotated if s.healthy and seconds(s) <= best * (1 + NEAR) + NEAR_S),
                  key=lambda s: -cached(s))
    return near + [s for s in ranked if s not in near]


def _queue_tokens(d: UpstreamState) -> int:
    """A decode instance's queue in prompt tokens: prompts waiting to be prefilled there, and the
    streams it runs (each makes every step, a new request's first included, a little longer)."""
    return LOAD_TOKENS * d.prefill_queue() + STREAM_TOKENS * d.outstanding


def _block_size(state: UpstreamState) -> int:
    return state.prefix_cache.block_size if state.prefix_cache is not None else 16


class _Cached:
    """Prompt tokens an instance caches: `held` from the index (what it can hand out now), and when
    called, with what this proxy placed there to be computed since (hashed once per way of hashing)."""

    def __init__(self, router: Router, ids: list[int], cache_salt, now: float):
        self.router, self.ids, self.salt, self.now = router, ids, cache_salt, now
        self._hashes: dict[tuple[str, int], list[int]] = {}
        self._held: dict[str, int] = {}
        self._memo: dict[str, int] = {}

    def __call__(self, state: UpstreamState) -> int:
        if state.url not in self._memo:
            held, hashes = self.held(state), self.of(state)
            blocks = held // _block_size(state)
            while blocks < len(hashes) and state.computing.get(hashes[blocks], 0) > self.now:
                blocks += 1
            self._memo[state.url] = max(held, blocks * _block_size(state))
        return self._memo[state.url]

    def held(self, state: UpstreamState) -> int:
        if state.url not in self._held:
            hashes = self.of(state)
            self._held[state.url] = self.router.index.cached_blocks(state.url, hashes) * _block_size(state) \
                if hashes else 0
        return self._held[state.url]

    def computing(self, state: UpstreamState, until: float) -> None:
        """The prompt's blocks `state` lacks are being computed there until `until` (forgotten after)."""
        state.computing = {h: t for h, t in state.computing.items() if t > self.now}
        for h in self.of(state)[self(state) // _block_size(state):]:
            state.computing[h] = until

    def of(self, state: UpstreamState) -> list[int]:
        info = state.prefix_cache
        if info is None or not info.enabled:
            return []
        key = (info.model_key, info.block_size)
        if key not in self._hashes:
            self._hashes[key] = block_hashes(self.ids, info, self.salt)
        return self._hashes[key]
