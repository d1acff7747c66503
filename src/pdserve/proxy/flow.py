"""One client request through the proxy: prefill on a producer, then decode with its params.

Proxy process (event loop). vLLM's two-call protocol (docs/design.md, "Wire"): the producer gets
the client's body with `stream: false` and `kv_transfer_params: {do_remote_decode: true}` and
answers with its first token and transfer params; the decode instance gets the client's body with
those params, and its answer goes to the client. When the producer's first token ends the request
(EOS or a stop) it returns no params and the proxy answers from the producer alone.

Upstream protocols: `pdserve` instances hand off after their first token whatever `max_tokens`
says, so the client's body goes to them unchanged, and a client that wants one token is simply
served by a producer without a transfer. `vllm` instances generate up to `max_tokens`, so they get
`max_tokens: 1`, as vLLM's own proxy sends. `auto` asks the first prefill instance who it is.
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


PROTOCOLS = ("auto", "pdserve", "vllm")


class PDFlow:
    def __init__(self, router: Router, metrics: ProxyMetrics, protocol: str = "auto"):
        assert protocol in PROTOCOLS
        self.router = router
        self.metrics = metrics
        self.protocol = None if protocol == "auto" else protocol

    async def upstream_protocol(self) -> str:
        """`auto`: the first prefill instance's `owned_by` says (asked once; pdserve until known)."""
        if self.protocol is None:
            owner = await self.router.prefill.upstreams[0].owner()
            if owner is not None:
                self.protocol = "vllm" if owner == "vllm" else "pdserve"
                logger.info("upstream protocol: %s (the prefill instance is owned by %r)", self.protocol, owner)
        return self.protocol or "pdserve"

    async def handle(self, raw_body: bytes, path: str, request_id: str) -> Response:
        start = time.monotonic()
        body = parse_body(raw_body)
        body.pop("kv_transfer_params", None)  # the producer's word, never the client's
        headers = {"X-Request-Id": request_id}
        protocol = await self.upstream_protocol()
        prefill, decode = self.router.prefill.pick(), self.router.decode.pick()
        if protocol == "pdserve" and _max_tokens(body) == 1:  # nothing to decode: no transfer
            self.metrics.requests.labels("prefill_only").inc()
            return await self._forward(self.router.prefill, prefill, "prefill", path, body, headers, start)

        p_body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        p_body["stream"] = False
        p_body["kv_transfer_params"] = PREFILL_PARAMS
        if protocol == "vllm":
            p_body["max_tokens"] = 1
            if "max_completion_tokens" in p_body:
                p_body["max_completion_tokens"] = 1
        p_resp = await self._post(self.router.prefill, prefill, "prefill", path, p_body, headers)
        self.metrics.prefill.observe(time.monotonic() - start)
        if p_resp.status_code != 200:
            self.metrics.requests.labels(f"prefill_{p_resp.status_code}").inc()
            return Response(p_resp.content, status_code=p_resp.status_code,
                            media_type="application/json", headers=headers)
        p_json = p_resp.json()
        kv = p_json.get("kv_transfer_params")
        if not kv and (protocol == "pdserve" or _all_stopped(p_json)):
            # the first token ended it (EOS, a stop, or the context is full): the producer's answer
            self.metrics.requests.labels("prefill_only").inc()
            if body.get("stream"):
                return StreamingResponse(as_stream(p_json, body), media_type="text/event-stream",
                                         headers=headers)
            return JSONResponse(p_json, headers=headers)
        # (a vLLM producer without a connector returns no params: decode then does it all)
        self.metrics.requests.labels("disaggregated" if kv else "decode_only").inc()
        d_body = {**body, "kv_transfer_params": kv} if kv else body
        return await self._forward(self.router.decode, decode, "decode", path, d_body, headers, start)

    async def _forward(self, pool: Pool, upstream: Upstream, role: str, path: str, body: dict,
                       headers: dict, start: float) -> Response:
        """The client's answer comes from this upstream, streamed or whole."""
        if body.get("stream"):
            return StreamingResponse(self._relay(upstream, role, path, body, headers, start),
                                     media_type="text/event-stream", headers=headers)
        resp = await self._post(pool, upstream, role, path, body, headers)
        self.metrics.e2e.observe(time.monotonic() - start)
        return Response(resp.content, status_code=resp.status_code,
                        media_type="application/json", headers=headers)

    async def _post(self, pool: Pool, upstream: Upstream, role: str, path: str, body: dict, headers: dict):
        try:
            return await upstream.post_json(path, body, headers)
        except UpstreamError as e:
            pool.mark_down(upstream)
            self.metrics.upstream_errors.labels(role).inc()
            raise APIError(502, f"{role} instance unreachable: {e}") from None

    async def _relay(self, upstream: Upstream, role: str, path: str, body: dict, headers: dict,
                     start: float):
        """Stream an instance's SSE through, timing it as the client sees it."""
        m = self.metrics
        first = last = None
        events = 0
        try:
            async with upstream.stream(path, body, headers) as resp:
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
            m.upstream_errors.labels(role).inc()
            logger.warning("%s stream from %s broke: %s", role, upstream.url, e)
            yield f"data: {json.dumps(APIError(502, f'{role} instance failed: {e}').body())}\n\n"
            yield "data: [DONE]\n\n"
            return
        end = time.monotonic()
        m.e2e.observe(end - start)
        if first is not None and events > 1:
            m.tpot.observe((end - first) / (events - 1))


def _max_tokens(body: dict):
    value = body.get("max_completion_tokens")
    return body.get("max_tokens") if value is None else value


def _all_stopped(answer: dict) -> bool:
    return all(c.get("finish_reason") == "stop" for c in answer.get("choices") or [{}])


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
