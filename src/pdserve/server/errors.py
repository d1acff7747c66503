"""Errors at the HTTP edge, as OpenAI-style JSON: {"error": {"message", "type", "param", "code"}}.

Server and proxy processes. Exceptions from inside (bad input, engine death) are mapped here once;
a handler never formats an error itself and a client never sees a traceback.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from pdserve.sampling_params import InvalidRequestError
from pdserve.server.protocol import ErrorInfo, ErrorResponse

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
          500: "InternalServerError", 502: "BadGatewayError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "Error")
        self.param = param

    @classmethod
    def bad_request(cls, e: InvalidRequestError) -> "APIError":
        return cls(400, str(e), "BadRequestError", e.field)

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.status)
        return ErrorResponse(error=info).model_dump()

    def response(self, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def validation_error(errors: list[dict]) -> APIError:
    """pydantic's first complaint, with its location as the field name."""
    if not errors:
        return APIError(400, "invalid request")
    e = errors[0]
    loc = [str(p) for p in e.get("loc", ()) if p != "body"]
    if e.get("type") == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {e.get('msg', '')}", param="body")
    field = ".".join(loc) or "body"
    return APIError(400, f"{field}: {e.get('msg', 'invalid value')}", param=field)
