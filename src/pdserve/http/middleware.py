"""Pure ASGI middleware of the server and the proxy: request id, API key, one log line per request,
and the request body's size limit.

Server and proxy processes. Plain ASGI rather than Starlette's BaseHTTPMiddleware, which relays
every streamed chunk through an extra task and memory stream.
"""

from __future__ import annotations

import asyncio
import contextvars
import hmac
import logging
import time
import uuid

from pdserve.http.errors import APIError

logger = logging.getLogger("pdserve.server")
request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


class RequestIdFilter(logging.Filter):
    """Puts the current request id on every log record (`%(request_id)s`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True


# Behind the API key when one is set (/health is not; the proxy's /admin has a key of its own).
PROTECTED = ("/v1", "/debug", "/metrics", "/kv", "/reset_prefix_cache", "/tokenize", "/detokenize")  # not /ping, /version


class RequestContext:
    """Takes the client's X-Request-Id (or makes one), echoes it on the response, checks the API
    key on every route but /health, and logs each /v1 request with its status and time to first
    byte."""

    def __init__(self, app, api_key: str | None = None, log: bool = True):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.log = log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        rid = headers.get(b"x-request-id", b"").decode("latin-1") or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        request_id_var.set(rid)
        path = scope.get("path", "")
        start = time.monotonic()
        rid_header = (b"x-request-id", rid.encode("latin-1"))

        if self.expected and path.startswith(PROTECTED) and \
                not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
            response = APIError(401, "missing or invalid API key").response({"X-Request-Id": rid})
            return await response(scope, receive, send)

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [h for h in message.get("headers", [])
                                      if h[0].lower() != b"x-request-id"] + [rid_header]
                if self.log and path.startswith("/v1"):
                    logger.info("%s %s -> %d in %.3f s", scope.get("method"), path,
                                message["status"], time.monotonic() - start)
            await send(message)
        await self.app(scope, receive, send_with_id)


DRAIN_MIN_BYTES = 64 << 20  # drained past the limit at least, so any client can read the answer
DRAIN_S = 10.0


class BodyLimit:
    """A request body larger than `max_bytes` gets a 413 in OpenAI's shape, whether it says its
    length up front or streams it; nothing past the limit is kept in memory.

    Clients such as urllib and httpx send the whole body before they read the answer: a server
    that answers early and closes with the body unread makes the kernel reset the connection, and
    the client never sees the answer. So before any response that leaves the body unread (this
    413, or an early 401 or 503 from inside), the rest is read and dropped, up to
    max(4 x the limit, 64 MiB) and 10 s; past those bounds the connection is closed instead. A
    client that waits for `100 Continue` has sent nothing and is answered at once."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes
        self.drain_bytes = max(4 * max_bytes, DRAIN_MIN_BYTES)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length", b"")
        body = _Body(int(declared) if declared.isdigit() else None,
                     headers.get(b"expect", b"").lower() == b"100-continue")
        if body.declared is not None and body.declared > self.max_bytes:
            return await self._refuse(scope, body, receive, send)

        async def limited_receive():
            message = await receive()
            if message["type"] == "http.request":
                body.received += len(message.get("body", b""))
                body.done = not message.get("more_body", False)
                if body.received > self.max_bytes:
                    body.too_large = True
                    return {"type": "http.disconnect"}  # the app stops reading; its answer is replaced
            return message

        async def draining_send(message):
            if body.too_large:
                return
            if message["type"] == "http.response.start" and not body.done and not await self._drain(body, receive):
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)
        await self.app(scope, limited_receive, draining_send)
        if body.too_large:
            await self._refuse(scope, body, receive, send)

    async def _refuse(self, scope, body: "_Body", receive, send):
        drained = await self._drain(body, receive)
        error = APIError(413, f"request body larger than {self.max_bytes} bytes", param="body")
        await error.response(None if drained else {"Connection": "close"})(scope, receive, send)

    async def _drain(self, body: "_Body", receive) -> bool:
        """Read and drop the rest of the body; False when it is not read to its end."""
        if body.done or (body.expect_continue and not body.received):
            return body.done
        if body.declared is not None and body.declared > self.drain_bytes:
            return False  # could never be read to its end
        try:
            async with asyncio.timeout(DRAIN_S):
                while body.received <= self.drain_bytes:
                    message = await receive()
                    if message["type"] != "http.request":
                        return False
                    body.received += len(message.get("body", b""))
                    if not message.get("more_body", False):
                        body.done = True
                        return True
        except TimeoutError:
            pass
        return False


class _Body:
    """What the middleware knows of one request's body."""

    def __init__(self, declared: int | None, expect_continue: bool):
        self.declared = declared
        self.expect_continue = expect_continue
        self.received = 0
        self.done = False
        self.too_large = False


class Admission:
    """At most `limit` generation requests (POST /v1/...) in flight, from arrival to their last
    byte, streamed or not; the next one gets a 503 with Retry-After at once. Counted before
    anything is awaited, so a burst is admitted exactly up to the limit."""

    def __init__(self, app, limit: int, retry_after_s: int = 1):
        self.app = app
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.count = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or not scope.get("path", "").startswith("/v1/"):
            return await self.app(scope, receive, send)
        if self.count >= self.limit:
            error = APIError(503, f"overloaded: {self.count} requests in flight (--max-pending {self.limit})")
            return await error.response({"Retry-After": str(self.retry_after_s)})(scope, receive, send)
        self.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.count -= 1
