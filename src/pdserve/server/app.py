"""The OpenAI-compatible server of one instance: app factory and routes.

Server process. Routes are thin: parse (pydantic), hand to the serving layer, map errors. The engine
starts in the background so `/health` answers 503 until it is ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

import msgspec

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from pdserve.config import EngineConfig, ServerConfig
from pdserve.engine.engine import OverloadedError
from pdserve.health import Health
from pdserve.heap import PauseTimer, freeze_startup_heap
from pdserve.kv_transfer.params import KVTransferParams
from pdserve.model.generation_config import GenerationDefaults
from pdserve.sampling_params import InvalidRequestError
from pdserve.server.async_engine import AsyncEngine, EngineDeadError
from pdserve.http.errors import APIError, install_handlers, validation_error
from pdserve.http.heap_metrics import HeapMetrics
from pdserve.server.metrics import ServerMetrics
from pdserve.server.prefix_cache_routes import add_prefix_cache_routes
from pdserve.http.middleware import Admission, BodyLimit, RequestContext
from pdserve.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from pdserve.server.tools import ToolPolicy
from pdserve.server.serving_chat import ChatServing
from pdserve.server.serving_completion import CompletionServing
from pdserve.server.vllm_routes import add_vllm_routes

logger = logging.getLogger("pdserve.server")


def create_app(server: ServerConfig, engine_config: EngineConfig) -> FastAPI:
    model_name = server.served_model_name or Path(engine_config.model).name
    engine = AsyncEngine(engine_config)
    metrics = ServerMetrics(model_name)
    collections = PauseTimer()
    metrics.registry.register(HeapMetrics("pdserve", collections))
    defaults = GenerationDefaults.from_dir(engine_config.model, server.generation_config)
    completions = CompletionServing(engine, model_name, metrics, defaults)
    chat = ChatServing(engine, model_name, metrics, defaults,
                       trust_request_chat_template=server.trust_request_chat_template,
                       tool_policy=ToolPolicy(server.enable_auto_tool_choice, server.tool_call_parser))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        collections.install()
        starting = asyncio.create_task(engine.start())
        starting.add_done_callback(_started)
        try:
            yield
        finally:  # uvicorn has stopped accepting and finished in-flight HTTP requests
            await engine.drain(server.drain_timeout_s)
            await engine.stop()
            chat.close()
            collections.uninstall()

    app = FastAPI(title="pdserve", lifespan=lifespan)
    app.add_middleware(RequestContext, api_key=server.api_key)
    app.add_middleware(Admission, limit=server.max_pending)
    app.add_middleware(BodyLimit, max_bytes=server.max_request_body_bytes)
    install_handlers(app)
    app.state.engine = engine
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        metrics.errors.labels(model_name, str(e.status)).inc()
        if e.status >= 500:
            logger.error("request failed: %s", e.message)
        return e.response()

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(request: Request, e: InvalidRequestError):
        return await api_error(request, APIError.bad_request(e))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, e: RequestValidationError):
        return await api_error(request, validation_error(e.errors()))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, e: EngineDeadError):
        return await api_error(request, APIError(503, f"engine unavailable: {e}"))

    @app.exception_handler(OverloadedError)
    async def overloaded(request: Request, e: OverloadedError):
        return await api_error(request, APIError(503, f"overloaded: {e}", headers={"Retry-After": "1"}))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        logger.exception("unexpected error")
        return await api_error(request, APIError(500, f"internal error: {type(e).__name__}: {e}"))

    @app.get("/health")
    async def health():
        """200 with the load a router weighs and any warnings; 503 until the engine runs."""
        if not engine.is_ready:
            status = "failed: " + engine.error if engine.error else "starting"
            return APIError(503, f"engine {status}").response()
        load, warnings = engine.snapshot  # as of the engine's last turn: never waits for a step
        cache = engine.engine.kv_events.info()  # settings and a counter: safe to read from here
        health = Health(engine_id=engine.engine.engine_id, load=load, warnings=warnings, prefix_cache=cache)
        return Response(msgspec.json.encode(health), media_type="application/json")

    @app.post("/kv/release")
    async def release(body: dict):
        """The proxy found no decode instance for a producer answer: free its lease now."""
        params = KVTransferParams.parse(body.get("kv_transfer_params") if isinstance(body, dict) else None)
        if params is None:
            raise InvalidRequestError("kv_transfer_params", "is required")
        _require_ready(engine)
        return {"released": await engine.call(lambda e: e.connector.release_handoff(params))}

    @app.get("/v1/models")
    async def models():
        max_len = engine.engine.max_model_len if engine.is_ready else None
        return ModelList(data=[ModelCard(id=model_name, root=engine_config.model,
                                         max_model_len=max_len)]).model_dump()

    @app.get("/metrics")
    async def prometheus():
        if engine.is_ready:
            metrics.update_engine(await engine.call(lambda e: e.stats(drain=True)))
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request):
        _require_ready(engine)
        return await completions.create(body, _request_id(body, request), request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        _require_ready(engine)
        return await chat.create(body, _request_id(body, request), request)

    add_prefix_cache_routes(app, engine)
    add_vllm_routes(app, engine, chat)
    if server.enable_debug_endpoints:
        from pdserve.server.debug import add_debug_routes
        add_debug_routes(app, engine)
    return app


def _request_id(body, request: Request) -> str:
    """vLLM's order: the client's X-Request-Id, else the body's `request_id`, else one of ours."""
    if body.request_id and not request.headers.get("x-request-id"):
        return body.request_id
    return request.state.request_id


def _require_ready(engine: AsyncEngine) -> None:
    if not engine.is_ready:
        raise APIError(503, "engine is " + (f"down: {engine.error}" if engine.error else "starting"))


def _started(task: asyncio.Task) -> None:
    if task.cancelled():
        return
    if task.exception() is not None:
        logger.error("engine failed to start: %s", task.exception())
    else:
        logger.info("engine ready (%d start-up objects frozen)", freeze_startup_heap())
