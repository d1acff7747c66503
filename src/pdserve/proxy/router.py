"""Which prefill and which decode instance serve a request (xPyD: any P with any D).

Proxy process. Round-robin over each pool independently, skipping instances marked unhealthy by
the last failed request until they answer `/health` again.
"""

from __future__ import annotations

import itertools

from pdserve.proxy.upstream import Upstream


class Pool:
    def __init__(self, upstreams: list[Upstream]):
        self.upstreams = upstreams
        self._next = itertools.cycle(range(len(upstreams)))
        self.down: set[str] = set()

    def pick(self) -> Upstream:
        for _ in range(len(self.upstreams)):
            u = self.upstreams[next(self._next)]
            if u.url not in self.down:
                return u
        return self.upstreams[next(self._next)]  # all marked down: try anyway

    def mark_down(self, upstream: Upstream) -> None:
        self.down.add(upstream.url)

    async def refresh(self) -> dict[str, bool]:
        status = {}
        for u in self.upstreams:
            status[u.url] = await u.healthy()
            (self.down.discard if status[u.url] else self.down.add)(u.url)
        return status


class Router:
    def __init__(self, prefill: list[Upstream], decode: list[Upstream]):
        self.prefill = Pool(prefill)
        self.decode = Pool(decode)
