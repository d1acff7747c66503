"""The legs of a request through the proxy: sending it to the instances of a pool in order until
one takes it, streaming or whole, and the bookkeeping of what each instance holds from this proxy.

Proxy process (event loop). Each leg tries the pool's instances in the placement's order while they
refuse (503) or cannot be reached; while every producer refuses the request waits (bounded). A
producer's error (another 5xx) is not "busy": the others are tried once each, then the error is
passed on. A decode leg is sent to one instance only once it may have arrived there (its params are
single-use): if that instance then fails, the client gets a 502 naming it. Leases handed back to a
producer keep its client open until they are (`Upstream.hold`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.http.errors import APIError
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.relay import carries_token, error_body, relay
from pdserve.proxy.router import Pool, UpstreamState
from pdserve.proxy.upstream import Reply, Stream, UpstreamError

logger = logging.getLogger("pdserve.proxy")

EMPTY = "no instance"


class NoTaker(Exception):
    """Every instance of a pool refused or could not be reached."""

    def __init__(self, role: str, refused: bool, detail: str):
        super().__init__(detail)
        self.role, self.refused, self.detail = role, refused, detail

    def error(self) -> APIError:
        if self.detail == EMPTY:  # a cluster has not registered any yet (or dropped them all)
            return APIError(503, f"no {self.role} instance registered", headers={"Retry-After": "1"})
        if self.refused:
            return APIError(503, f"every {self.role} instance is busy: {self.detail}")
        return APIError(502, f"no {self.role} instance reachable: {self.detail}")


class Legs:
    def __init__(self, metrics: ProxyMetrics, max_wait_s: float):
        self.metrics = metrics
        self.max_wait_s = max_wait_s
        self._keys = itertools.count()

    async def post(self, pool: Pool, path: str, body: dict, headers: dict,
                    prefills: bool = False, rank: list[UpstreamState] | None = None) -> tuple[UpstreamState, Reply]:
        """The first whole answer that is not a refusal (`prefills`: the prompt is prefilled there;
        no first token is seen, so it counts until the instance's next report or the answer)."""
        async def send(state: UpstreamState) -> Reply:
            key = next(self._keys)
            if prefills:
                state.unseen[key] = time.monotonic()
            try:
                return await state.upstream.post_json(path, body, headers)
            finally:
                state.unseen.pop(key, None)
        state, resp = await self.take(pool, send, rank=rank)
        self.count(pool, state, -1)
        return state, resp

    async def answer(self, pool: Pool, path: str, body: dict, headers: dict, start: float,
                      prefills: bool = False, rank: list[UpstreamState] | None = None) -> Response:
        """The client's answer from the first instance of the pool (in `rank`'s order) that takes
        the request (`prefills`: the prompt is prefilled there, which counts until its first token)."""
        if not body.get("stream"):
            _, resp = await self.post(pool, path, body, headers, prefills, rank)
            self.metrics.e2e.observe(time.monotonic() - start)
            return passed_on(resp, headers)
        state, resp = await self.take(pool, lambda s: s.upstream.open_stream(path, body, headers), prefills,
                                       rank)
        if resp.status_code != 200:
            detail = (await resp.read()).decode(errors="replace")
            await resp.close()
            self.count(pool, state, -1, prefills)
            return JSONResponse(error_body(resp.status_code, detail), status_code=resp.status_code, headers=headers)
        return StreamingResponse(self._stream(pool, state, resp, start, prefills), media_type="text/event-stream",
                                 headers=headers)

    async def take(self, pool: Pool, send, prefills: bool = False,
                    rank: list[UpstreamState] | None = None) -> tuple[UpstreamState, Reply | Stream]:
        """`send` to the pool's instances, best first, until one does not refuse. While every
        producer refuses (busy: its blocks are held for readers) the request waits, up to
        `max_wait_s`, as it would in a queue, holding nothing meanwhile; a decode leg does not wait
        (a lease is running). The instance that took it stays counted as outstanding."""
        deadline = time.monotonic() + (self.max_wait_s if pool.role == "prefill" else 0)
        pause = 0.1
        while True:
            try:
                return await self.take_once(pool, send, prefills, rank)
            except NoTaker:
                if time.monotonic() + pause > deadline:
                    raise
            await asyncio.sleep(pause)
            pause = min(1.0, pause * 2)

    async def take_once(self, pool: Pool, send, prefills: bool,
                         rank: list[UpstreamState] | None) -> tuple[UpstreamState, Reply | Stream]:
        """One try of every instance (in `rank`'s order, else least loaded first). A producer's error
        answer is kept and, if nobody takes the request, passed on (it ends the wait: it is no refusal)."""
        last, refused, failed = EMPTY, False, None
        for i, state in enumerate(rank if rank is not None else pool.candidates()):
            if state not in pool.states:  # it left the pool while an earlier one was tried
                continue
            if i:
                self.metrics.retries.labels(pool.role).inc()
            self.count(pool, state, +1, prefills)
            try:
                resp = await send(state)
            except UpstreamError as e:
                self.count(pool, state, -1, prefills)
                self._failed(pool, state, e)
                if e.sent and pool.role == "decode":  # it may hold the single-use params now
                    raise APIError(502, f"decode instance {state.url} failed after taking the request: {e}") \
                        from None
                last = str(e)
                continue
            if resp.status_code == 503 or (pool.role == "prefill" and resp.status_code >= 500
                                           and resp.status_code != 504):
                self.count(pool, state, -1, prefills)
                outcome = "refused" if resp.status_code == 503 else "failed"
                self.metrics.upstream_requests.labels(pool.role, state.url, outcome).inc()
                if outcome == "refused":
                    await resp.close()
                    refused, last = True, f"{state.url} answered {resp.status_code}"
                else:
                    if failed is not None:
                        await failed[1].close()
                    failed = (state, resp)
                continue
            self.metrics.upstream_requests.labels(pool.role, state.url, "ok").inc()
            return state, resp
        if failed is not None:
            self.count(pool, failed[0], +1, prefills)  # the caller counts it down with its answer
            return failed
        raise NoTaker(pool.role, refused, last)

    async def _stream(self, pool: Pool, state: UpstreamState, resp: Stream, start: float, prefills: bool):
        try:
            async for chunk in relay(resp, pool.role, state.url, self.metrics, start):
                if prefills and carries_token(chunk):  # that prompt's prefill is done
                    state.prefilling -= 1
                    prefills = False
                yield chunk
        finally:
            await resp.close()
            self.count(pool, state, -1, prefills)

    # --- bookkeeping ------------------------------------------------------------------------------

    def release(self, producer: UpstreamState, kv: dict, headers: dict) -> None:
        """Hand a lease back to its producer (a task of its own: a client that left cannot stop it;
        the producer's client stays open until it is done)."""
        async def release():
            try:
                r = await producer.upstream.post_json("/kv/release", {"kv_transfer_params": kv}, headers)
                if r.status_code == 200 and r.json().get("released"):
                    self.metrics.releases.inc()
            except (UpstreamError, ValueError) as e:
                logger.info("could not hand the lease back to %s: %s", producer.url, e)
            finally:
                producer.upstream.unhold()
        producer.upstream.hold()
        asyncio.ensure_future(release())

    def _failed(self, pool: Pool, state: UpstreamState, error: UpstreamError) -> None:
        """A call that broke. An instance that did not answer in time may be alive and busy: it
        stays up; any other failure marks it down until a probe finds it up."""
        if not error.timeout:
            pool.mark_down(state, str(error))
        self.metrics.upstream_errors.labels(pool.role).inc()
        self.metrics.upstream_requests.labels(pool.role, state.url, "timeout" if error.timeout
                                              else "unreachable").inc()

    def count(self, pool: Pool, state: UpstreamState, delta: int, prefills: bool = False) -> None:
        state.outstanding += delta
        if prefills:
            state.prefilling += delta
        self.metrics.outstanding.labels(pool.role, state.url).set(state.outstanding)


def passed_on(resp: Reply, headers: dict) -> Response:
    return Response(resp.content, status_code=resp.status_code, media_type="application/json", headers=headers)
