"""One upstream instance as the proxy sees it: a pooled HTTP client with bounded timeouts.

Proxy process. One `httpx.AsyncClient` per upstream, reused by every request.
"""

from __future__ import annotations

import json

import httpx


_JSON = {"Content-Type": "application/json"}


def _encode(body: dict) -> bytes:
    """The client's JSON as the instance should judge it (a NaN the client sent stays a NaN: the
    instance answers 400 naming the field, as it would to the client directly)."""
    return json.dumps(body, allow_nan=True).encode()


class UpstreamError(RuntimeError):
    """The upstream could not be reached or broke the connection (the proxy answers 502)."""


class Upstream:
    def __init__(self, url: str, api_key: str | None, connect_timeout_s: float, timeout_s: float):
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(
            base_url=self.url, headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))

    async def post_json(self, path: str, body: dict, headers: dict) -> httpx.Response:
        try:
            return await self.client.post(path, content=_encode(body), headers={**headers, **_JSON})
        except httpx.HTTPError as e:
            raise UpstreamError(f"{self.url}{path}: {type(e).__name__}: {e}") from e

    async def open_stream(self, path: str, body: dict, headers: dict) -> httpx.Response:
        """A streaming response whose status and headers have arrived; the caller closes it."""
        request = self.client.build_request("POST", path, content=_encode(body), headers={**headers, **_JSON})
        try:
            return await self.client.send(request, stream=True)
        except httpx.HTTPError as e:
            raise UpstreamError(f"{self.url}{path}: {type(e).__name__}: {e}") from e

    async def owner(self) -> str | None:
        """`owned_by` of the instance's first model ("pdserve", "vllm", ...); None if unknown."""
        try:
            r = await self.client.get("/v1/models", timeout=5.0)
            return r.json()["data"][0].get("owned_by")
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, AttributeError):
            return None

    async def health(self) -> tuple[bool, dict | None]:
        """(healthy, the load it reports: queue and KV use; None when it reports none)."""
        try:
            r = await self.client.get("/health", timeout=2.0)
        except httpx.HTTPError:
            return False, None
        if r.status_code != 200:
            return False, None
        try:
            body = r.json()
        except ValueError:
            return True, None
        return True, body.get("load") if isinstance(body, dict) else None

    async def close(self) -> None:
        await self.client.aclose()
