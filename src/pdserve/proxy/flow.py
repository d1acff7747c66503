"""One client request through the proxy: prefill on a producer, then decode with its params.

Proxy process (event loop). vLLM's proxy protocol, so the request and response shapes are vLLM's
(docs/design.md, "Wire"): the producer gets the client's body with `stream: false` and
`kv_transfer_params: {do_remote_decode: true}`; when its first token already ends the request it
returns no transfer parameters and the proxy answers from the producer alone; otherwise the decode
instance gets the client's body with the producer's params and its answer goes to the client.
"""

from __future__ import annotations

import json
import logging
import time

from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.http.errors import APIError
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.router import Pool, Router
from pdserve.proxy.upstream import Upstream, UpstreamError

logger = logging.getLogger("pdserve.proxy")

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


class PDFlow:
    def __init__(self, router: Router, metrics: ProxyMetrics):
        self.router = router
        self.metrics = metrics

    async def handle(self, raw_body: bytes, path: str, request_id: str) -> Response:
        start = time.monotonic()
        body = parse_body(raw_body)
        headers = {"X-Request-Id": request_id}
        prefill, decode = self.router.prefill.pick(), self.router.decode.pick()

        p_body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        p_body["stream"] = False
        p_body["kv_transfer_params"] = PREFILL_PARAMS
        p_resp = await self._post(self.router.prefill, prefill, "prefill", path, p_body, headers)
        self.metrics.prefill.observe(time.monotonic() - start)
        if p_resp.status_code != 200:
            self.metrics.requests.labels(f"prefill_{p_resp.status_code}").inc()
            return Response(p_resp.content, status_code=p_resp.status_code,
                            media_type="application/json", headers=headers)
        p_json = p_resp.json()
        kv = p_json.get("kv_transfer_params")
        if not kv:  # the first token ended it (EOS, stop, max_tokens == 1): the producer's answer
            self.metrics.requests.labels("prefill_only").inc()
            if body.get("stream"):
                return StreamingResponse(as_stream(p_json, body), media_type="text/event-stream",
                                         headers=headers)
            return JSONResponse(p_json, headers=headers)

        d_body = {**body, "kv_transfer_params": kv}
        self.metrics.requests.labels("disaggregated").inc()
        if body.get("stream"):
            return StreamingResponse(self._relay(decode, path, d_body, headers, start),
                                     media_type="text/event-stream", headers=headers)
        d_resp = await self._post(self.router.decode, decode, "decode", path, d_body, headers)
        self.metrics.e2e.observe(time.monotonic() - start)
        return Response(d_resp.content, status_code=d_resp.status_code,
                        media_type="application/json", headers=headers)

    async def _post(self, pool: Pool, upstream: Upstream, role: str, path: str, body: dict, headers: dict):
        try:
            return await upstream.post_json(path, body, headers)
        except UpstreamError as e:
            pool.mark_down(upstream)
            self.metrics.upstream_errors.labels(role).inc()
            raise APIError(502, f"{role} instance unreachable: {e}") from None

    async def _relay(self, decode: Upstream, path: str, body: dict, headers: dict, start: float):
        """Stream the decode instance's SSE through, timing it as the client sees it."""
        m = self.metrics
        first = last = None
        events = 0
        try:
            async with decode.stream(path, body, headers) as resp:
                if resp.status_code != 200:
                    detail = (await resp.aread()).decode(errors="replace")
                    yield f"data: {json.dumps(error_body(resp.status_code, detail))}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                async for chunk in resp.aiter_raw():
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
        except Exception as e:  # noqa: BLE001 - the stream has started: end it with an error event
            m.upstream_errors.labels("decode").inc()
            logger.warning("decode stream from %s broke: %s", decode.url, e)
            yield f"data: {json.dumps(APIError(502, f'decode instance failed: {e}').body())}\n\n"
            yield "data: [DONE]\n\n"
            return
        end = time.monotonic()
        m.e2e.observe(end - start)
        if first is not None and events > 1:
            m.tpot.observe((end - first) / (events - 1))


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}", param="body") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", param="body")
    return body


def error_body(status: int, detail: str) -> dict:
    try:
        return json.loads(detail)
    except json.JSONDecodeError:
        return APIError(status, detail).body()


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
