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


def carries_token(chunk: bytes) -> bool:
    """Whether an SSE chunk has an event that follows the prompt's prefill: a token (chat deltas after
    the opening one, which has only the role and is sent before the prompt is prefilled; pdserve
    sends `"role": null` in every later delta), an end or an error. A usage-only event or [DONE]
    alone is not one."""
    for event in chunk.split(b"\n\n"):
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            continue
        try:
            body = json.loads(event[6:])
        except ValueError:
            return True  # not ours to judge: something came back
        if not isinstance(body, dict) or "error" in body:
            return True
        for choice in body.get("choices") or ():
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if not isinstance(delta, dict) or not delta.get("role") or delta.get("content") \
                    or choice.get("finish_reason") is not None or delta.get("tool_calls"):
                return True
    return False


async def relay(resp: Stream, role: str, url: str, m: ProxyMetrics, start: float):
    """An instance's SSE events, as they come, timed from the first that carries a token; a broken
    stream ends with an error event."""
    first = last = None
    events = 0
    try:
        async for chunk in resp.chunks():
            now = time.monotonic()
            n = chunk.count(b"data: ") - chunk.count(b"data: [DONE]")
            if first is None and not carries_token(chunk):
                n = 0
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
    options = request.get("stream_options") or {}
    if options.get("include_usage") and options.get("continuous_usage_stats"):  # on every chunk (vLLM)
        base["usage"] = full.get("usage")
    for choice in full["choices"]:
        if chat:
            delta = {"role": "assistant", "content": choice["message"]["content"]}
            c = {"index": choice["index"], "delta": delta, "logprobs": choice.get("logprobs"),
                 "finish_reason": choice["finish_reason"], "stop_reason": choice.get("stop_reason")}
            chunk = {**base, "object": "chat.completion.chunk", "choices": [c]}
        else:
            chunk = {**base, "object": "text_completion", "choices": [choice]}
        yield f"data: {json.dumps(chunk)}\n\n"
    if options.get("include_usage"):
        obj = "chat.completion.chunk" if chat else "text_completion"
        yield f"data: {json.dumps({**base, 'object': obj, 'choices': [], 'usage': full.get('usage')})}\n\n"
    yield "data: [DONE]\n\n"
