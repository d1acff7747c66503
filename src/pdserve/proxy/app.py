"""The P -> D proxy's app factory and routes; the flow of one request is in flow.py.

Proxy process. Clients reach this process; it reaches the instances (docs/design.md, "Processes").
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from pdserve.config import ProxyConfig
from pdserve.heap import PauseTimer, freeze_startup_heap
from pdserve.http.errors import APIError, install_handlers
from pdserve.http.heap_metrics import HeapMetrics
from pdserve.http.middleware import BodyLimit, RequestContext
from pdserve.http.version import version
from pdserve.proxy.copies import Copies
from pdserve.proxy.decision import DisaggPolicy
from pdserve.proxy.flow import PDFlow
from pdserve.proxy.kv_index import KVIndex
from pdserve.proxy.prompts import PromptTokens
from pdserve.proxy.relay import parse_body
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.router import Router, retire
from pdserve.proxy.upstream import Upstream, UpstreamError

logger = logging.getLogger("pdserve.proxy")


def create_app(config: ProxyConfig) -> FastAPI:
    def upstream(url: str) -> Upstream:
        return Upstream(url, config.upstream_api_key, config.connect_timeout_s, config.request_timeout_s)

    index = KVIndex(config.upstream_api_key, config.kv_events_drop_fraction, config.kv_events_drop_seed) \
        if config.routing == "kv-aware" else None
    copies = Copies() if index is not None and config.kv_copies == "one" else None
    router = Router([upstream(u) for u in config.prefill_urls], [upstream(u) for u in config.decode_urls],
                    config.probe_interval_s, config.routing, index, copies)
    prompts = PromptTokens(config.tokenizer, config.chat_template) if config.tokenizer else None
    metrics = ProxyMetrics()
    collections = PauseTimer()
    metrics.registry.register(HeapMetrics("pdserve_proxy", collections))
    placements = PlacementLog(config.placement_log) if config.placement_log else None
    flow = PDFlow(router, metrics, config.upstream_protocol, config.max_wait_s,
                  DisaggPolicy(config.local_prefill_max_tokens, config.local_prefill_max_queue), prompts,
                  placements)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        router.start()  # background probes: instances that come back rejoin by themselves
        collections.install()
        freeze_startup_heap()
        try:
            yield
        finally:
            await router.stop()
            collections.uninstall()
            if placements is not None:
                placements.close()

    app = FastAPI(title="pdserve proxy", lifespan=lifespan)
    app.add_middleware(RequestContext, api_key=config.api_key, log=False)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_body_bytes)
    install_handlers(app)
    app.state.router = router

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return e.response()

    @app.get("/health")
    async def health():
        status = await router.probe()
        ok = (any(status["prefill"].values()) or not status["prefill"]) and any(status["decode"].values())
        return JSONResponse(status, status_code=200 if ok else 503)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        """vLLM's (SageMaker's) health check: /health's status, no body."""
        return Response(status_code=(await health()).status_code)

    @app.get("/version")
    async def get_version():
        return {"version": version()}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await any_instance("/tokenize", await request.body(), request.state.request_id)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await any_instance("/detokenize", await request.body(), request.state.request_id)

    async def any_instance(path: str, raw: bytes, request_id: str) -> Response:
        """Every instance serves one model with one tokenizer: the first healthy one answers."""
        body = parse_body(raw)
        for state in router.decode.candidates() + router.prefill.candidates():
            try:
                r = await state.upstream.post_json(path, body, {"X-Request-Id": request_id})
            except UpstreamError:
                continue
            if r.status_code != 503:
                return Response(r.content, status_code=r.status_code, media_type="application/json")
        raise APIError(503, "no instance could answer", headers={"Retry-After": "1"})

    @app.get("/kv/index")
    async def kv_index(hashes: bool = False):
        """How many blocks the KV index holds for each instance (absent: not indexed); with
        `?hashes=true`, the hashes themselves (64-bit, as in events); `repairs`: what each
        instance's follower received, lost and repaired since it started."""
        out, repairs = {}, {}
        for state in router.prefill.states + router.decode.states:
            held = index.indexed(state.url) if index is not None else None
            if held is not None:
                out[state.url] = sorted(held) if hashes else len(held)
                repairs[state.url] = index.repairs(state.url)
        return {"routing": config.routing, "instances": out, "repairs": repairs}

    @app.get("/metrics")
    async def prometheus():
        for pool in (router.prefill, router.decode):
            for state in pool.states:
                metrics.healthy.labels(pool.role, state.url).set(int(state.healthy))
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    closing: set[asyncio.Task] = set()

    @app.put("/admin/upstreams")
    async def set_upstreams(request: Request):
        """A cluster (pdserve up --ray) says which instances exist now: {"prefill": [...], "decode": [...]}.
        Ones that leave get no new requests; their requests in flight finish."""
        if config.admin_key is None:
            raise APIError(404, "not found")
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {config.admin_key}".encode()):
            raise APIError(401, "admin key missing or wrong")
        body = parse_body(await request.body())
        wanted = {}
        for role in ("prefill", "decode"):
            urls = body.get(role)
            if not isinstance(urls, list) or not all(isinstance(u, str) and u.startswith(("http://", "https://"))
                                                     for u in urls):
                raise APIError(400, f"{role}: must be a list of http(s) URLs", param=role)
            wanted[role] = list(dict.fromkeys(u.rstrip("/") for u in urls))
        for pool in (router.prefill, router.decode):
            for state in pool.set_members(wanted[pool.role], upstream):
                closing.add(task := asyncio.ensure_future(retire(state)))
                task.add_done_callback(closing.discard)
        return {"prefill": [s.url for s in router.prefill.states], "decode": [s.url for s in router.decode.states]}

    @app.get("/v1/models")
    async def models():
        candidates = router.decode.candidates()
        if not candidates:
            raise APIError(503, "no decode instance registered yet", headers={"Retry-After": "1"})
        target = candidates[0].upstream
        try:
            r = await target.get("/v1/models")
        except UpstreamError as e:
            raise APIError(502, f"decode instance {target.url} unreachable: {e}") from None
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await flow.handle(await request.body(), "/v1/completions", request.state.request_id,
                                 request.is_disconnected)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await flow.handle(await request.body(), "/v1/chat/completions", request.state.request_id,
                                 request.is_disconnected)

    return app


class PlacementLog:
    """Appends each placement to `path` as a JSON line (line-buffered: a line is whole once written);
    closed when the proxy stops."""

    def __init__(self, path: str):
        self.out = open(path, "a", buffering=1)

    def __call__(self, placement: dict) -> None:
        self.out.write(json.dumps(placement) + "\n")

    def close(self) -> None:
        self.out.close()
