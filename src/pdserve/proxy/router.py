"""Which prefill and which decode instance serve a request (xPyD: any P with any D).

Proxy process (event loop). A proxy without producers balances plain requests over its decode
pool. Each pool orders its instances for one request: healthy before down,
then by load: what this proxy has outstanding there plus the queue and KV use the instance reported
at its last probe (`GET /health`, every `probe_interval_s`, in the background, so an instance that
comes back rejoins by itself). The flow tries them in that order; a connection error marks an
instance down until a probe finds it up, a 503 only moves on to the next.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from typing import Callable

from pdserve.health import PrefixCacheInfo
from pdserve.proxy.copies import Copies
from pdserve.proxy.kv_index import KVIndex
from pdserve.proxy.policy import POLICIES, order
from pdserve.proxy.upstream import Upstream

logger = logging.getLogger("pdserve.proxy")


@dataclasses.dataclass
class UpstreamState:
    upstream: Upstream
    healthy: bool = True  # until a probe or a request says otherwise
    outstanding: int = 0  # requests this proxy has in flight there
    queued: int = 0  # waiting requests the instance reported (queue + waiting for KV)
    waiting: int = 0  # ... of which waiting to be prefilled there
    others_running: int = 0  # requests it ran at the last probe beyond those this proxy had there
    # then (other proxies' streams)
    prefilling: int = 0  # prompts this proxy sent there to prefill that have no first token yet
    unseen: dict = dataclasses.field(default_factory=dict)  # whole-answer prefills sent there since
    # the last probe began (key -> monotonic time): no first token is seen, the next report counts them
    kv_usage: float = 0.0  # fraction of its KV blocks in use, as reported
    kv_holder: dict | None = None  # where producers may claim blocks it caches (signed by it)
    engine_id: str = ""  # as its last report said (a restarted instance is a new engine)
    prefix_cache: PrefixCacheInfo | None = None  # how it hashes blocks (for the KV index)
    prefill_tokens_per_s: float = 0.0  # as it measured its own steps (0: not yet)
    decode_step_s: float = 0.0  # ... a step that only decodes (0: not yet)
    max_prefill_stall_s: float = 0.0  # how long one step of a prefill there holds its streams (0: all of it)
    computing: dict = dataclasses.field(default_factory=dict)  # block hash -> until when this proxy
    # expects the instance to be computing that block of a prompt it placed there (placement.py)
    last_probe: float = 0.0

    @property
    def url(self) -> str:
        return self.upstream.url

    def score(self) -> tuple:
        return (not self.healthy, self.outstanding + self.queued, self.kv_usage)

    def streams(self) -> int:
        """Requests it is running or about to: this proxy's in flight there, and other proxies' as of
        the last probe."""
        return self.outstanding + self.others_running

    def prefill_queue(self) -> int:
        """Prompts waiting to be prefilled there: what this proxy sent with no first token back yet,
        or what the instance reported waiting, whichever is more (the report also counts other
        proxies' requests, but is up to a probe old), plus whole-answer prefills sent since the
        last probe began."""
        return max(self.prefilling, self.waiting) + len(self.unseen)


class Pool:
    def __init__(self, role: str, upstreams: list[Upstream], index: KVIndex | None = None):
        self.role = role
        self.states = [UpstreamState(u) for u in upstreams]
        self.index = index  # what each instance caches, from its KV events (kv-aware routing)
        self._turn = itertools.count()

    @property
    def upstreams(self) -> list[Upstream]:
        return [s.upstream for s in self.states]

    def candidates(self) -> list[UpstreamState]:
        """Every instance, least loaded first; equals take turns (so idle instances share the load)."""
        return self.ordered("least-loaded")

    def rotated(self) -> list[UpstreamState]:
        """Every instance, starting one further each call (so equals take turns once sorted)."""
        turn, n = next(self._turn), len(self.states)
        return [self.states[(turn + i) % n] for i in range(n)]

    def ordered(self, policy: str) -> list[UpstreamState]:
        """Every instance, best first by `policy` (policy.py)."""
        if not self.states:
            return []
        return order(policy, self.states, next(self._turn))

    def set_members(self, urls: list[str], make: Callable[[str], Upstream]) -> list[UpstreamState]:
        """Serve exactly these instances from now on: known ones keep their state (and client),
        `make` builds the new ones. Returns the states that left: their requests in flight go on,
        close each once it has none."""
        known = {s.url: s for s in self.states}
        self.states = [known.get(url) or UpstreamState(make(url)) for url in urls]
        left = [s for url, s in known.items() if url not in set(urls)]
        for s in left:
            if self.index is not None:
                self.index.drop(s.url)  # its entries vanish at once
        return left

    def least_queued(self) -> int:
        """The shortest queue among healthy instances (what this proxy has outstanding there plus
        what each reported waiting)."""
        return min((s.outstanding + s.queued for s in self.states if s.healthy), default=1 << 30)

    def least_prefilling(self) -> int:
        """The fewest prompts waiting to be prefilled on a healthy instance: what this proxy sent
        there with no first token back yet, or what the instance reported waiting, whichever is more
        (the report also counts other proxies' requests, but is up to a probe old). Streams an
        instance is already generating are not counted: a decode instance with many of them may
        still have time for a short prefill. Prompts whose answer comes whole count until a probe
        that began after they were sent."""
        return min((s.prefill_queue() for s in self.states if s.healthy), default=1 << 30)

    def mark_down(self, state: UpstreamState, reason: str) -> None:
        if state.healthy:
            logger.warning("%s instance %s is down: %s", self.role, state.url, reason)
        state.healthy = False

    async def probe(self) -> dict[str, bool]:
        """Ask every instance how it is; returns url -> healthy."""
        began = time.monotonic()
        states = list(self.states)
        results = await asyncio.gather(*(s.upstream.health() for s in states))
        for state, (healthy, report) in zip(states, results):
            if healthy and not state.healthy:
                logger.info("%s instance %s is back", self.role, state.url)
            state.healthy = healthy
            state.last_probe = time.monotonic()
            if self.index is not None and state in self.states:
                self.index.update(state.url, report if healthy else None)
            if report is not None:
                load = report.load
                state.engine_id = report.engine_id
                state.prefix_cache = report.prefix_cache
                state.prefill_tokens_per_s = load.prefill_tokens_per_s
                state.decode_step_s = load.decode_step_s
                state.max_prefill_stall_s = load.max_prefill_stall_s
                state.waiting = load.num_waiting
                state.others_running = max(0, load.num_running - state.outstanding)
                state.queued = load.num_waiting + load.num_waiting_for_remote_kv
                state.kv_usage = load.kv_cache_usage
                state.kv_holder = load.kv_holder
                state.unseen = {k: t for k, t in state.unseen.items() if t >= began}  # in its report now
        return {s.url: s.healthy for s in states}


async def retire(state: UpstreamState, poll_s: float = 0.5, limit_s: float = 3600.0) -> None:
    """An instance that left the pool: its client closes once no request uses it (streams may be
    long) and no lease it handed out may still have to go back."""
    waited = 0.0
    while (state.outstanding > 0 or state.upstream.in_use > 0) and waited < limit_s:
        await asyncio.sleep(poll_s)
        waited += poll_s
    await state.upstream.close()


class Router:
    def __init__(self, prefill: list[Upstream], decode: list[Upstream], probe_interval_s: float = 1.0,
                 policy: str = "least-loaded", index: KVIndex | None = None, copies: Copies | None = None):
        assert policy in POLICIES, policy
        self.policy = policy
        self.index = index
        self.copies = copies  # kv-aware: which pool keeps a disaggregated prompt's KV (copies.py)
        self.prefill = Pool("prefill", prefill, index)
        self.decode = Pool("decode", decode, index)
        self.probe_interval_s = probe_interval_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._probe_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for u in self.prefill.upstreams + self.decode.upstreams:
            await u.close()
        if self.index is not None:
            self.index.close()

    async def probe(self) -> dict[str, dict[str, bool]]:
        p, d = await asyncio.gather(self.prefill.probe(), self.decode.probe())
        return {"prefill": p, "decode": d}

    async def _probe_forever(self) -> None:
        while True:
            try:
                await self.probe()
            except Exception:  # noqa: BLE001 - probing must outlive one bad answer
                logger.exception("probing the instances failed")
            await asyncio.sleep(self.probe_interval_s)
