"""Bodies in and out of the proxy: parsing the client's JSON, passing an instance's SSE stream through
(timed as the client sees it), re-sending a complete answer as SSE, errors in OpenAI's shape.

Proxy process (event loop).
"""

from __future__ import annotations

import json
import logging
import time

from pdserve.http.errors import APIError
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.upstream import Stream, UpstreamError

logger = logging.getLogger("pdserve.proxy")


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}", param="body") from None
    except RecursionError:
        raise APIError(400, "request body is nested too deeply", param="body") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", param="body")
    return body


def error_body(status: int, detail: str) -> dict:
    try:
        return json.loads(detail)
    except json.JSONDecodeError:
        return APIError(status, detail).body()


async def relay(resp: Stream, role: str, url: str, m: ProxyMetrics, start: float):
    """An instance's SSE events, as they come; a broken stream ends with an error event."""
    first = last = None
    events = 0
    try:
        async for chunk in resp.chunks():
            now = time.monotonic()
            n = chunk.count(b"data: ") - chunk.count(b"data: [DONE]")
            if n > 0:
                if first is None:
                    first = now
                    m.ttft.observe(now - start)
                elif last is not None:
                    m.itl.observe((now - last) / n)
                last, events = now, events + n
            yield chunk
    except UpstreamError as e:  # the stream has started: end it with an error event
        m.upstream_errors.labels(role).inc()
        logger.warning("%s stream from %s broke: %s", role, url, e)
        yield f"data: {json.dumps(APIError(502, f'{role} instance failed: {e}').body())}\n\n"
        yield "data: [DONE]\n\n"
        return
    end = time.monotonic()
    m.e2e.observe(end - start)
    if first is not None and events > 1:
        m.tpot.observe((end - first) / (events - 1))


async def as_stream(full: dict, request: dict):
    """A complete (non-streamed) producer answer, re-sent as SSE chunks in vLLM's shape."""
    chat = full.get("object") == "chat.completion"
    base = {"id": full["id"], "created": full["created"], "model": full["model"]}
    for choice in full["choices"]:
        if chat:
            delta = {"role": "assistant", "content": choice["message"]["content"]}
            c = {"index": choice["index"], "delta": delta, "logprobs": choice.get("logprobs"),
                 "finish_reason": choice["finish_reason"], "stop_reason": choice.get("stop_reason")}
            chunk = {**base, "object": "chat.completion.chunk", "choices": [c]}
        else:
            chunk = {**base, "object": "text_completion", "choices": [choice]}
        yield f"data: {json.dumps(chunk)}\n\n"
    if (request.get("stream_options") or {}).get("include_usage"):
        obj = "chat.completion.chunk" if chat else "text_completion"
        yield f"data: {json.dumps({**base, 'object': obj, 'choices': [], 'usage': full.get('usage')})}\n\n"
    yield "data: [DONE]\n\n"
