"""Serving logic shared by completions and chat: request -> engine requests -> responses or SSE.

Server process (event loop). One HTTP request may fan out to several engine requests (`n`, or a
batch of prompts); their deltas are merged in arrival order. Every engine request that is not
finished when the handler leaves (client gone, error) is aborted, so its blocks come back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import AsyncIterator

from pdserve.http.errors import APIError
from pdserve.kv_transfer.params import KVTransferParams
from pdserve.model.generation_config import GenerationDefaults
from pdserve.outputs import RequestOutput
from pdserve.sampling_params import InvalidRequestError, SamplingParams
from pdserve.server.async_engine import AsyncEngine
from pdserve.server.metrics import ServerMetrics
from pdserve.server.protocol import Usage, refused_field, unknown_fields
from pdserve.server.structured import structured_outputs
from pdserve.text.prompts import text_prompt_ids

logger = logging.getLogger("pdserve.server")
MAX_CHARS_PER_TOKEN = 64


@dataclass
class Choice:
    """Accumulated state of one choice (one engine request)."""

    index: int
    engine_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None
    error: str | None = None
    finished: bool = False
    prompt_logprobs: list | None = None  # with prompt_logprobs (or echo): one entry per prompt token

    def add(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.token_ids.extend(out.new_token_ids)
        if out.new_logprobs:
            self.logprobs.extend(out.new_logprobs)
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.finished = True
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason
            self.kv_transfer_params = out.kv_transfer_params
            self.error = out.error


class BaseServing:
    def __init__(self, engine: AsyncEngine, model_name: str, metrics: ServerMetrics,
                 defaults: GenerationDefaults = GenerationDefaults()):
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.defaults = defaults  # the checkpoint's generation_config.json
        self.ignored_fields: set[str] = set()  # unknown request fields already logged

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    def check_length(self, text: str, field: str) -> None:
        """Refuse a prompt before tokenizing when the text could never fit the context (no token
        is longer than MAX_CHARS_PER_TOKEN characters in practice)."""
        limit = self.engine.engine.max_model_len * MAX_CHARS_PER_TOKEN
        if len(text) > limit:
            raise InvalidRequestError(field, f"is too long: {len(text)} characters, more than the "
                                             f"context of {self.engine.engine.max_model_len} tokens can hold")

    def encode(self, text: str, field: str) -> list[int]:
        """A completion prompt's token ids (text/prompts.py: as the proxy computes them)."""
        self.check_length(text, field)
        return text_prompt_ids(self.tokenizer, text)

    def truncated(self, req, ids: list[int]) -> list[int]:
        """vLLM's `truncate_prompt_tokens`: the prompt's last k tokens (-1: as many as the context
        holds); the proxy cuts its copy the same way (proxy/prompts.py)."""
        k, limit = req.truncate_prompt_tokens, self.engine.engine.max_model_len
        if k is None:
            return ids
        if isinstance(k, bool) or not isinstance(k, int) or not (k >= 1 or k == -1):
            raise InvalidRequestError("truncate_prompt_tokens", f"must be a positive integer or -1, got {k!r}")
        if k > limit:
            raise InvalidRequestError("truncate_prompt_tokens", f"is {k}, more than the context of {limit} "
                                                                "tokens")
        return ids[-(limit if k == -1 else k):]

    # --- request -> sampling params ----------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

    def sampling_params(self, req, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """Unset fields take the checkpoint's generation_config.json value, then pdserve's.
        `prompt_logprobs`: the request's own unless given (completions' echo asks for them)."""
        self.check_fields(req)
        d = self.defaults
        top_k = _first(req.top_k, d.top_k, 0)
        return SamplingParams(
            n=req.n,
            temperature=_first(req.temperature, d.temperature, 1.0),
            top_p=_first(req.top_p, d.top_p, 1.0),
            top_k=0 if top_k < 0 else top_k,
            seed=req.seed,
            max_tokens=_first(max_tokens, d.max_tokens, None),
            stop=tuple([req.stop] if isinstance(req.stop, str) else (req.stop or ())),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=req.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=_first(req.repetition_penalty, d.repetition_penalty, 1.0),
            min_p=_first(req.min_p, d.min_p, 0.0),
            min_tokens=req.min_tokens,
            logit_bias=_logit_bias(req.logit_bias),
            allowed_token_ids=tuple(req.allowed_token_ids) if req.allowed_token_ids is not None else None,
            bad_words=tuple(req.bad_words or ()),
            structured=structured_outputs(req),
        )

    def check_fields(self, req) -> None:
        """A field pdserve does not implement, set to anything but its neutral value, is a 400
        naming it; a field of neither vLLM's nor OpenAI's schema is logged once and ignored."""
        name = refused_field(req)
        if name is not None:
            raise InvalidRequestError(name, f"is not supported by pdserve (got {getattr(req, name)!r}; "
                                            "leave it unset)")
        if req.stream and req.prompt_logprobs:  # vLLM's rule; 0 asks for none
            raise InvalidRequestError("prompt_logprobs", "are not available when `stream=True`")
        for name in unknown_fields(req):
            if name not in self.ignored_fields:
                self.ignored_fields.add(name)
                logger.warning("request field %r is not one of vLLM's or OpenAI's; ignored", name)

    @staticmethod
    def transfer_params(req, num_prompts: int) -> KVTransferParams | None:
        params = KVTransferParams.parse(req.kv_transfer_params)
        if params is not None and (params.do_remote_decode or params.do_remote_prefill):
            if req.n != 1 and params.do_remote_decode:  # a consumer forks n samples (start)
                raise InvalidRequestError("n", "must be 1 for a P/D producer request (the proxy "
                                               "prefills each prompt once)")
            if num_prompts != 1:
                raise InvalidRequestError("prompt", "a disaggregated (P/D) request takes one prompt")
        return params

    # --- engine requests ------------------------------------------------------------------------

    async def start(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                    kv: KVTransferParams | None, cache_salt: str | None = None) -> tuple[list[Choice], list]:
        """Add every (prompt, sample) engine request; on any rejection, abort those already added.
        Engine request ids are this instance's own (a P/D producer hands its id to the consumer as
        `remote_request_id`): the client's X-Request-Id may be long or reused, so it only names
        the request in the logs. A P/D consumer's first sample continues from the producer's first
        token and READs the prompt's KV; its other samples wait for that KV, find the prompt in the
        prefix cache and draw their own first tokens (seed + i) from its last block, computed here.
        A consumer computes no prompt logprobs: the proxy takes them from the producer's answer."""
        choices, streams = [], []
        suffix = uuid.uuid4().hex
        try:
            for p_index, prompt in enumerate(prompts):
                for i in range(params.n):
                    index = p_index * params.n + i
                    seed = None if params.seed is None else params.seed + i
                    sub = replace(params, n=1, seed=seed)
                    engine_id = f"{suffix}-{index}"
                    sample_kv, after = kv, None
                    if kv is not None and kv.do_remote_prefill:
                        sub = replace(sub, prompt_logprobs=None)
                        if i > 0:
                            sample_kv, after = None, f"{suffix}-{p_index * params.n}"
                    streams.append(await self.engine.add_request(engine_id, prompt, sub, sample_kv,
                                                                 cache_salt, after))
                    choices.append(Choice(index, engine_id))
        except BaseException:
            for s in streams:
                self.engine.abort(s.request_id)
            raise
        logger.debug("request %s: engine requests %s-0..%d", request_id, suffix, len(choices) - 1)
        self.metrics.prompt_tokens.labels(self.model_name).inc(
            sum(len(p) for p in prompts) * params.n)
        for _ in prompts:  # once per prompt, its n samples together
            self.metrics.vllm.request_started(params.n, params.max_tokens)
        return choices, streams

    async def merged(self, choices: list[Choice], streams: list) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        """Deltas of every choice as they come; aborts unfinished engine requests on exit."""
        queue: asyncio.Queue = asyncio.Queue()
        start = time.monotonic()
        last_token_at: dict[int, float] = {}
        first_token_at: dict[int, float] = {}

        async def pump(choice: Choice, stream):
            try:
                async for out in stream:
                    await queue.put((choice, out))
            except BaseException as e:  # noqa: BLE001 - engine death, delivered to the reader
                await queue.put((choice, e))

        tasks = [asyncio.create_task(pump(c, s)) for c, s in zip(choices, streams)]
        remaining = len(choices)
        try:
            while remaining:
                choice, out = await queue.get()
                if isinstance(out, BaseException):
                    raise APIError(500, str(out), "InternalServerError")
                self._observe(choice, out, start, last_token_at, first_token_at)
                choice.add(out)
                if out.finished:
                    remaining -= 1
                yield choice, out
        finally:
            for t in tasks:
                t.cancel()
            for c in choices:
                if not c.finished:
                    self.engine.abort(c.engine_id)

    def _observe(self, choice: Choice, out: RequestOutput, start: float, last: dict, first: dict) -> None:
        now, m = time.monotonic(), self.model_name
        if out.new_token_ids:
            self.metrics.generation_tokens.labels(m).inc(len(out.new_token_ids))
            prev = last.get(choice.index)
            if prev is None:
                first[choice.index] = now
                self.metrics.ttft.labels(m).observe(now - start)
            else:
                self.metrics.itl.labels(m).observe((now - prev) / len(out.new_token_ids))
            last[choice.index] = now
        if out.finished:
            self.metrics.e2e.labels(m).observe(now - start)
            self.metrics.vllm.request_finished(out.num_prompt_tokens, len(choice.token_ids) + len(out.new_token_ids),
                                               out.arrival_time, out.scheduled_time, first.get(choice.index), now)
            self.metrics.requests.labels(m, out.finish_reason or "unknown").inc()

    async def collect(self, raw_request, choices: list[Choice], streams: list) -> None:
        """Non-streaming: run every choice to its end (aborted if the client goes away); an engine
        error in any of them is the response. A P/D hand-off whose client has left by then gives
        its lease back at once: nobody will get the params."""
        watcher = asyncio.create_task(self.watch_disconnect(raw_request, choices))
        try:
            async for _ in self.merged(choices, streams):
                pass
        finally:
            watcher.cancel()
        if any(c.kv_transfer_params for c in choices) and await raw_request.is_disconnected():
            for c in choices:
                self.engine.abort(c.engine_id)
        error = next((c.error for c in choices if c.error), None)
        if error:
            raise APIError(500, error)

    async def events(self, choices: list[Choice], streams: list, chunk, usage_chunk=None):
        """Streaming: one SSE event per delta (`chunk(choice, out)`), an error event for a failed
        choice, the usage event if asked, then [DONE]."""
        try:
            async for choice, out in self.merged(choices, streams):
                if out.error:
                    yield sse(APIError(500, out.error).body())
                elif out.new_text or out.finished or out.new_token_ids:
                    yield sse(chunk(choice, out))
            if usage_chunk is not None:
                yield sse(usage_chunk())
        except APIError as e:
            yield sse(e.body())
        yield SSE_DONE

    async def watch_disconnect(self, raw_request, choices: list[Choice]) -> None:
        """Non-streaming requests: a client that goes away aborts its engine requests."""
        while not all(c.finished for c in choices):
            if await raw_request.is_disconnected():
                for c in choices:
                    if not c.finished:
                        self.engine.abort(c.engine_id)
                return
            await asyncio.sleep(0.25)

    def prompt_logprobs(self, entries) -> list[dict | None] | None:
        """vLLM's `prompt_logprobs`: per prompt token, None for the first, else token id -> its
        logprob, rank and text, for the prompt's token and the most likely ones."""
        if entries is None:
            return None
        tok, out = self.tokenizer, []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            entry = {str(t): {"logprob": lp, "rank": r + 1, "decoded_token": tok.token_text(t)}
                     for r, (t, lp) in enumerate(e.top or [])}
            entry.setdefault(str(e.token_id), {"logprob": e.logprob, "rank": e.rank,
                                               "decoded_token": tok.token_text(e.token_id)})
            out.append(entry)
        return out

    @staticmethod
    def usage(choices: list[Choice], num_prompts: int, n: int) -> Usage:
        prompt = sum(c.num_prompt_tokens for c in choices[::n]) if choices else 0
        completion = sum(len(c.token_ids) for c in choices)
        cached = sum(c.num_cached_tokens for c in choices[::n])
        return Usage(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion,
                     prompt_tokens_details={"cached_tokens": cached} if cached else None)



def continuous_usage(req) -> bool:
    """vLLM's `stream_options.continuous_usage_stats`: with `include_usage`, every chunk carries
    the usage so far."""
    return bool(req.stream_options and req.stream_options.include_usage
                and req.stream_options.continuous_usage_stats)


def with_usage(chunk):
    """`chunk(choice, out)` whose answer carries that choice's usage so far (prompt, tokens sent)."""
    def chunk_with_usage(choice: Choice, out):
        body = chunk(choice, out)
        body.usage = running_usage(choice.num_prompt_tokens, len(choice.token_ids))
        return body
    return chunk_with_usage


def running_usage(num_prompt_tokens: int, num_completion_tokens: int) -> Usage:
    return Usage(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                 total_tokens=num_prompt_tokens + num_completion_tokens)


def _first(*values):
    return next((v for v in values if v is not None), None)


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's keys are token ids as strings."""
    try:
        return tuple((int(t), b) for t, b in (bias or {}).items())
    except ValueError:
        raise InvalidRequestError("logit_bias", "keys must be token ids") from None


def sse(payload) -> str:
    body = payload.model_dump_json(exclude_unset=False) if hasattr(payload, "model_dump_json") \
        else json.dumps(payload)
    return f"data: {body}\n\n"


SSE_DONE = "data: [DONE]\n\n"
