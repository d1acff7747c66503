"""The P -> D proxy: each completion goes to a prefill instance (max one token, KV kept), then to a
decode instance with the producer's `kv_transfer_params`, whose answer streams to the client.

Proxy process. Follows vLLM's proxy protocol (DESIGN §2), so the request and response shapes are
vLLM's. The user's `max_tokens` goes to the producer unchanged: when the producer's first token
already ends the request (EOS, a stop, max_tokens 1) it returns no transfer parameters and the
proxy answers from the producer alone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from pdserve.config import ProxyConfig
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.router import Router
from pdserve.proxy.upstream import Upstream, UpstreamError
from pdserve.server.errors import APIError
from pdserve.server.middleware import RequestContext

logger = logging.getLogger("pdserve.proxy")

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


def create_app(config: ProxyConfig) -> FastAPI:
    def upstreams(urls):
        return [Upstream(u, config.upstream_api_key, config.connect_timeout_s,
                         config.request_timeout_s) for u in urls]
    router = Router(upstreams(config.prefill_urls), upstreams(config.decode_urls))
    metrics = ProxyMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        for u in router.prefill.upstreams + router.decode.upstreams:
            await u.close()

    app = FastAPI(title="pdserve proxy", lifespan=lifespan)
    app.add_middleware(RequestContext, api_key=config.api_key, log=False)
    app.state.router = router

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return e.response()

    @app.get("/health")
    async def health():
        p = await router.prefill.refresh()
        d = await router.decode.refresh()
        ok = any(p.values()) and any(d.values())
        return JSONResponse({"prefill": p, "decode": d}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        upstream = router.decode.pick()
        try:
            r = await upstream.client.get("/v1/models")
        except Exception as e:  # noqa: BLE001
            raise APIError(502, f"decode instance {upstream.url} unreachable: {e}") from None
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, "/v1/chat/completions")

    async def handle(request: Request, path: str):
        start = time.monotonic()
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"request body is not valid JSON: {e}", param="body") from None
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object", param="body")
        rid = request.state.request_id
        headers = {"X-Request-Id": rid}
        prefill, decode = router.prefill.pick(), router.decode.pick()

        p_body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        p_body["stream"] = False
        p_body["kv_transfer_params"] = PREFILL_PARAMS
        p_resp = await post(router.prefill, prefill, "prefill", path, p_body, headers)
        metrics.prefill.observe(time.monotonic() - start)
        if p_resp.status_code != 200:
            metrics.requests.labels(f"prefill_{p_resp.status_code}").inc()
            return Response(p_resp.content, status_code=p_resp.status_code,
                            media_type="application/json", headers=headers)
        p_json = p_resp.json()
        kv = p_json.get("kv_transfer_params")
        if not kv:  # the first token ended it (EOS, stop, max_tokens == 1): the producer's answer
            metrics.requests.labels("prefill_only").inc()
            if body.get("stream"):
                return StreamingResponse(_as_stream(p_json, body), media_type="text/event-stream",
                                         headers=headers)
            return JSONResponse(p_json, headers=headers)

        d_body = dict(body)
        d_body["kv_transfer_params"] = kv
        metrics.requests.labels("disaggregated").inc()
        if body.get("stream"):
            return StreamingResponse(relay(decode, path, d_body, headers, start),
                                     media_type="text/event-stream", headers=headers)
        d_resp = await post(router.decode, decode, "decode", path, d_body, headers)
        metrics.e2e.observe(time.monotonic() - start)
        return Response(d_resp.content, status_code=d_resp.status_code,
                        media_type="application/json", headers=headers)

    async def post(pool, upstream: Upstream, role: str, path: str, body: dict, headers: dict):
        try:
            return await upstream.post_json(path, body, headers)
        except UpstreamError as e:
            pool.mark_down(upstream)
            metrics.upstream_errors.labels(role).inc()
            raise APIError(502, f"{role} instance unreachable: {e}") from None

    async def relay(decode: Upstream, path: str, body: dict, headers: dict, start: float):
        """Stream the decode instance's SSE through, timing it as the client sees it."""
        first = last = None
        events = 0
        try:
            async with decode.stream(path, body, headers) as resp:
                if resp.status_code != 200:
                    detail = (await resp.aread()).decode(errors="replace")
                    yield f"data: {json.dumps(_error_body(resp.status_code, detail))}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                async for chunk in resp.aiter_raw():
                    now = time.monotonic()
                    n = chunk.count(b"data: ") - chunk.count(b"data: [DONE]")
                    if n > 0:
                        if first is None:
                            first = now
                            metrics.ttft.observe(now - start)
                        elif last is not None:
                            metrics.itl.observe((now - last) / n)
                        last, events = now, events + n
                    yield chunk
        except Exception as e:  # noqa: BLE001 - the stream has started: end it with an error event
            metrics.upstream_errors.labels("decode").inc()
            logger.warning("decode stream from %s broke: %s", decode.url, e)
            yield f"data: {json.dumps(APIError(502, f'decode instance failed: {e}').body())}\n\n"
            yield "data: [DONE]\n\n"
            return
        end = time.monotonic()
        metrics.e2e.observe(end - start)
        if first is not None and events > 1:
            metrics.tpot.observe((end - first) / (events - 1))

    return app


def _error_body(status: int, detail: str) -> dict:
    try:
        return json.loads(detail)
    except json.JSONDecodeError:
        return APIError(status, detail).body()


async def _as_stream(full: dict, request: dict):
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
