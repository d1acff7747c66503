"""One upstream instance as the proxy sees it: a pooled HTTP client with bounded timeouts.

Proxy process (event loop). One aiohttp session per upstream, made on first use (inside the loop)
and reused by every request: its C parser costs about half of httpx's time per call here, and the
proxy pays it twice per request (bench/proxy_overhead.py). The rest of the proxy sees only
`Reply` (a whole answer), `Stream` (an answer arriving) and `UpstreamError`, which says whether the
request may have reached the instance (only one that surely did not may be sent elsewhere).
An upstream that leaves the pool is closed once nothing uses it (`in_use`: calls in flight, open
streams, and holds the flow takes while a lease it handed out may still have to go back).
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import msgspec

from pdserve.health import Health, decode_health

_JSON = {"Content-Type": "application/json"}
_FAILURES = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


def _encode(body: dict) -> bytes:
    """The client's JSON as the instance should judge it (a NaN the client sent stays a NaN: the
    instance answers 400 naming the field, as it would to the client directly)."""
    return json.dumps(body, allow_nan=True).encode()


class UpstreamError(RuntimeError):
    """The upstream could not be reached or broke the connection (the proxy answers 502).
    `sent`: the request may have reached it (the connection was made); `timeout`: no bytes came
    within the read timeout (the instance may be alive and still working on it)."""

    def __init__(self, message: str, sent: bool = True, timeout: bool = False):
        super().__init__(message)
        self.sent, self.timeout = sent, timeout


@contextlib.contextmanager
def _failing_as_upstream_error(where: str, sending: bool = False):
    """`sending`: the block sends a request, so a failure to connect means it was never sent."""
    try:
        yield
    except _FAILURES as e:
        never_sent = sending and isinstance(e, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError))
        timeout = isinstance(e, asyncio.TimeoutError) and not never_sent
        raise UpstreamError(f"{where}: {type(e).__name__}: {e}", sent=not never_sent, timeout=timeout) from e


class Reply:
    """A whole answer."""

    def __init__(self, status_code: int, content: bytes):
        self.status_code = status_code
        self.content = content

    def json(self):
        return json.loads(self.content)

    async def close(self) -> None:
        """Nothing is held (as `Stream.close`, so a refusal of either kind is closed alike)."""


class Stream:
    """An answer whose status and headers have arrived; the body comes with `chunks()`. Whoever
    holds it closes it: a stream not read to its end closes the connection, so the instance sees
    the client leave."""

    def __init__(self, resp: aiohttp.ClientResponse, where: str, upstream: "Upstream"):
        self._resp = resp
        self._where = where
        self._upstream: Upstream | None = upstream  # held until closed
        self.status_code = resp.status

    async def chunks(self):
        """The bytes as they arrive; a broken connection raises UpstreamError."""
        with _failing_as_upstream_error(self._where):
            async for chunk in self._resp.content.iter_any():
                yield chunk

    async def read(self) -> bytes:
        with _failing_as_upstream_error(self._where):
            return await self._resp.read()

    async def close(self) -> None:
        if self._resp.content.at_eof():
            self._resp.release()  # read whole: the connection goes back to the pool
        else:
            self._resp.close()
        if self._upstream is not None:
            self._upstream.unhold()
            self._upstream = None


class Upstream:
    def __init__(self, url: str, api_key: str | None, connect_timeout_s: float, timeout_s: float):
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # no total limit (a stream may be long); each connect and each wait for bytes is bounded
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s, sock_read=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self.in_use = 0  # calls in flight, open streams and holds (see `hold`)
        self.closed = False

    def hold(self) -> None:
        """Keep the client open (a lease this instance handed out may still have to go back)."""
        self.in_use += 1

    def unhold(self) -> None:
        self.in_use -= 1

    @property
    def session(self) -> aiohttp.ClientSession:
        if self.closed:
            raise UpstreamError(f"{self.url}: the instance left the pool", sent=False)
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers=self._headers, timeout=self._timeout, auto_decompress=False,
                connector=aiohttp.TCPConnector(limit=1024, limit_per_host=0, ttl_dns_cache=60))
        return self._session

    async def _request(self, method: str, path: str, body: dict | None, headers: dict | None,
                       timeout_s: float | None = None) -> Reply:
        # (aiohttp reads timeout=None as "no timeout at all": pass one only to replace the session's)
        timeout = {"timeout": aiohttp.ClientTimeout(total=timeout_s)} if timeout_s else {}
        data = None if body is None else _encode(body)
        self.hold()
        try:
            with _failing_as_upstream_error(self.url + path, sending=True):
                async with self.session.request(method, self.url + path, data=data, **timeout,
                                                headers={**(headers or {}), **_JSON} if data else headers) as r:
                    with _failing_as_upstream_error(self.url + path):  # it has answered: it was sent
                        return Reply(r.status, await r.read())
        finally:
            self.unhold()

    async def post_json(self, path: str, body: dict, headers: dict) -> Reply:
        return await self._request("POST", path, body, headers)

    async def get(self, path: str, timeout_s: float = 10.0) -> Reply:
        return await self._request("GET", path, None, None, timeout_s)

    async def open_stream(self, path: str, body: dict, headers: dict) -> Stream:
        self.hold()
        try:
            with _failing_as_upstream_error(self.url + path, sending=True):
                resp = await self.session.post(self.url + path, data=_encode(body), headers={**headers, **_JSON})
        except BaseException:
            self.unhold()
            raise
        return Stream(resp, self.url + path, self)

    async def owner(self) -> str | None:
        """`owned_by` of the instance's first model ("pdserve", "vllm", ...); None if unknown."""
        try:
            return (await self.get("/v1/models", timeout_s=5.0)).json()["data"][0].get("owned_by")
        except (UpstreamError, ValueError, KeyError, IndexError, TypeError, AttributeError):
            return None

    async def health(self) -> tuple[bool, Health | None]:
        """(healthy, what it reports: load, prefix cache; None when it reports nothing we read)."""
        try:
            r = await self.get("/health", timeout_s=2.0)
        except UpstreamError:
            return False, None
        if r.status_code != 200:
            return False, None
        try:
            return True, decode_health(r.content)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return True, None

    async def close(self) -> None:
        self.closed = True
        if self._session is not None:
            await self._session.close()
