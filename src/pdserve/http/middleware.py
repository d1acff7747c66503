"""Pure ASGI middleware of the server and the proxy: request id, API key, one log line per request,
and the request body's size limit.

Server and proxy processes. Plain ASGI rather than Starlette's BaseHTTPMiddleware, which relays
every streamed chunk through an extra task and memory stream.
"""

from __future__ import annotations

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
PROTECTED = ("/v1", "/debug", "/metrics", "/kv", "/reset_prefix_cache")


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


class _TooLarge(Exception):
    pass


class BodyLimit:
    """A request body larger than `max_bytes` gets a 413 in OpenAI's shape, whether it says its
    length up front or streams it; nothing past the limit is read into memory."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        received = 0
        started = False

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _TooLarge
            return message

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await self._refuse(scope, receive, send)

    async def _refuse(self, scope, receive, send):
        error = APIError(413, f"request body larger than {self.max_bytes} bytes", param="body")
        await error.response()(scope, receive, send)


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
