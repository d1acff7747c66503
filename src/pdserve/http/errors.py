"""Errors at the HTTP edge, as OpenAI-style JSON: {"error": {"message", "type", "param", "code"}}.

Server and proxy processes (both import this package; neither imports the other). Exceptions from
inside (bad input, engine death) are mapped here once; a handler never formats an error itself and
a client never sees a traceback.
"""

from __future__ import annotations

import logging
import re

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from pdserve.sampling_params import InvalidRequestError

logger = logging.getLogger("pdserve.http")


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
          405: "MethodNotAllowedError", 413: "RequestTooLargeError", 500: "InternalServerError",
          502: "BadGatewayError", 503: "ServiceUnavailableError"}


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str | None = None, param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "Error")
        self.param = param
        self.headers = headers or {}

    @classmethod
    def bad_request(cls, e: InvalidRequestError) -> "APIError":
        return cls(400, str(e), "BadRequestError", e.field)

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.status)
        return ErrorResponse(error=info).model_dump()

    def response(self, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers={**self.headers, **(headers or {})})


def validation_error(errors: list[dict]) -> APIError:
    """pydantic's first complaint, with its location as the field name."""
    if not errors:
        return APIError(400, "invalid request")
    e = errors[0]
    loc = []
    for part in e.get("loc", ())[1 if e.get("loc", ("",))[0] == "body" else 0:]:
        part = str(part)
        # pydantic names the union member it tried ("str", "list[str]"): not part of the field
        if part in _TYPE_TAGS or not re.fullmatch(r"[A-Za-z_]\w*|\d+", part):
            break
        loc.append(part)
    if e.get("type") == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {e.get('msg', '')}", param="body")
    field = ".".join(loc) or "body"
    return APIError(400, f"{field}: {e.get('msg', 'invalid value')}", param=field)


def from_http_exception(status: int, detail) -> APIError:
    """Starlette's own errors (unknown route, wrong method, an unparsable body) in OpenAI's shape."""
    message = detail if isinstance(detail, str) else str(detail)
    param = "body" if "body" in message.lower() else None
    return APIError(status, message, param=param)


def install_handlers(app) -> None:
    """Errors raised by the framework itself (routing, body parsing) answer in OpenAI's shape."""
    from starlette.exceptions import HTTPException

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return from_http_exception(e.status_code, e.detail).response(getattr(e, "headers", None))

    @app.exception_handler(RecursionError)
    async def too_deep(request, e: RecursionError):
        return APIError(400, "request body is nested too deeply", param="body").response()

    @app.exception_handler(Exception)
    async def unexpected(request, e: Exception):
        logger.exception("unexpected error")
        return APIError(500, f"internal error: {type(e).__name__}").response()
