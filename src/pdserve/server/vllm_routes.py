"""vLLM's utility routes on an instance: `GET /version`, `GET|POST /ping` (SageMaker's health
check), `POST /tokenize` and `POST /detokenize`, in vLLM's request and response shapes.

Server process (event loop; tokenizing runs in a worker thread). A completion prompt is tokenized
exactly as /v1/completions does (the tokenizer's special tokens unless `add_special_tokens` is
false), a chat exactly as /v1/chat/completions renders it (template options included), so
`tokens` are the ids a generation request with the same body would see.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from pdserve.http.errors import APIError, validation_error
from pdserve.http.version import version
from pdserve.sampling_params import InvalidRequestError
from pdserve.server.async_engine import AsyncEngine
from pdserve.server.protocol import ChatCompletionRequest
from pdserve.server.serving_chat import ChatServing


class TokenizeCompletionRequest(BaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatCompletionRequest):
    """Every field a chat completion renders its prompt from (template, kwargs, tools)."""

    add_special_tokens: bool = False  # vLLM's default for chat: the template places them
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


def add_vllm_routes(app: FastAPI, engine: AsyncEngine, chat: ChatServing) -> None:
    @app.get("/version")
    async def get_version():
        return {"version": version()}

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        """As /health: 200 once the engine runs, else 503."""
        if not engine.is_ready:
            raise APIError(503, "engine " + (f"failed: {engine.error}" if engine.error else "starting"))
        return Response(status_code=200)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _json(request)
        req = _parse(TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest, body)
        _ready(engine)
        chat.check_model(req.model)
        tokens = await asyncio.to_thread(_tokens, chat, req)
        tok = chat.tokenizer
        return TokenizeResponse(count=len(tokens), max_model_len=engine.engine.max_model_len, tokens=tokens,
                                token_strs=[tok.token_text(t) for t in tokens] if req.return_token_strs
                                else None).model_dump(exclude_none=True)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = _parse(DetokenizeRequest, await _json(request))
        _ready(engine)
        chat.check_model(req.model)
        vocab_size = engine.engine.spec.vocab_size
        if any(not 0 <= t < vocab_size for t in req.tokens):
            raise InvalidRequestError("tokens", f"token ids must be in [0, {vocab_size})")
        return {"prompt": await asyncio.to_thread(chat.tokenizer.decode, req.tokens)}


def _tokens(chat: ChatServing, req) -> list[int]:
    if isinstance(req, TokenizeChatRequest):
        ids = chat.prompt(req)  # rendered and encoded without special tokens, as a chat request is
        if req.add_special_tokens:  # the tokenizer's own around the rendered text (vLLM's encode(text, True))
            ids = chat.tokenizer.encode(chat.tokenizer.decode(ids, skip_special_tokens=False), True)
        return ids
    chat.check_length(req.prompt, "prompt")
    return chat.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)


async def _json(request: Request) -> dict:
    try:
        body = await request.json()
    except ValueError as e:
        raise APIError(400, f"request body is not valid JSON: {e}", param="body") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", param="body")
    return body


def _parse(model: type[BaseModel], body: dict):
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None


def _ready(engine: AsyncEngine) -> None:
    if not engine.is_ready:
        raise APIError(503, "engine is " + (f"down: {engine.error}" if engine.error else "starting"))
