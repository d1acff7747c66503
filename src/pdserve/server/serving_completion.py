"""`POST /v1/completions`. Server process, event loop.

`echo` puts the prompt before each choice's text (and, with `logprobs`, its tokens' logprobs before
the generated ones', None for the first); `max_tokens: 0` generates nothing (the engine draws one
token, dropped here): with echo and logprobs, that is how lm-eval scores a text. A P/D consumer has
no prompt logprobs: its echo entries are None, filled in by the proxy from the producer's answer.
"""

from __future__ import annotations

import asyncio

from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.sampling_params import InvalidRequestError
from pdserve.server.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest,
                                     CompletionResponse)
from pdserve.server.serving import BaseServing, Choice, continuous_usage, with_usage


class CompletionServing(BaseServing):
    def prompts(self, req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if not p or (isinstance(p, list) and any(isinstance(x, (str, list)) and not x for x in p)):
            raise InvalidRequestError("prompt", "must not be empty")
        if isinstance(p, str):
            return [self.encode(p, "prompt")]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        if all(isinstance(x, str) for x in p):
            return [self.encode(x, "prompt") for x in p]
        if all(isinstance(x, list) for x in p):
            return [list(x) for x in p]
        raise InvalidRequestError("prompt", "must be a string, a list of strings, or token ids")

    async def create(self, req: CompletionRequest, request_id: str, raw_request):
        self.check_model(req.model)
        if req.max_completion_tokens is not None:  # vLLM's alias, as on chat: it wins
            req.max_tokens = req.max_completion_tokens
        if req.suffix:
            raise InvalidRequestError("suffix", "is not supported")
        if req.max_tokens is not None and req.max_tokens < 0:
            raise InvalidRequestError("max_tokens", f"must be at least 0, got {req.max_tokens}")
        prompts = await asyncio.to_thread(self.prompts, req)  # tokenizing never blocks the event loop
        prompts = [self.truncated(req, p) for p in prompts]
        score = req.prompt_logprobs
        if score is None and req.echo and req.logprobs is not None:
            score = req.logprobs
        params = self.sampling_params(req, 1 if req.max_tokens == 0 else req.max_tokens, req.logprobs, score)
        kv = self.transfer_params(req, len(prompts))
        choices, streams = await self.start(request_id, prompts, params, kv, req.cache_salt)
        response_id = f"cmpl-{request_id}"
        if req.stream:
            return StreamingResponse(self._stream(req, response_id, choices, streams, prompts),
                                     media_type="text/event-stream")
        await self.collect(raw_request, choices, streams)
        if req.max_tokens == 0:
            for c in choices:
                c.text, c.token_ids, c.logprobs, c.finish_reason = "", [], [], "length"
        body = CompletionResponse(
            id=response_id, model=self.model_name,
            choices=[self._choice(req, c, prompts[c.index // req.n], c.text, c.token_ids,
                                  c.logprobs if params.logprobs is not None else None)
                     for c in choices],
            usage=self.usage(choices, len(prompts), req.n),
            kv_transfer_params=choices[0].kv_transfer_params if len(choices) == 1 else None)
        return JSONResponse(body.model_dump())

    def _stream(self, req: CompletionRequest, response_id: str, choices: list[Choice], streams,
                prompts: list[list[int]]):
        offsets = {c.index: 0 for c in choices}
        started: set[int] = set()

        def chunk(choice: Choice, out) -> CompletionResponse:
            text, token_ids, entries = out.new_text, out.new_token_ids, out.new_logprobs
            if req.max_tokens == 0:  # the one token drawn is not the client's
                text, token_ids, entries = "", [], [] if entries is not None else None
                choice.token_ids.clear()
            if choice.index in started:
                logprobs = None
                if entries is not None:
                    logprobs = self._logprobs(entries, offsets[choice.index])
                offsets[choice.index] += len(text)
                c = CompletionChoice(index=choice.index, text=text, logprobs=logprobs,
                                     token_ids=token_ids if req.return_token_ids else None)
            else:  # the first event of a choice carries the echoed prompt and prompt logprobs
                started.add(choice.index)
                c = self._choice(req, choice, prompts[choice.index // req.n], text, token_ids, entries)
                offsets[choice.index] = sum(len(t) for t in c.logprobs.tokens) if c.logprobs else 0
            c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
            return CompletionResponse(id=response_id, model=self.model_name, choices=[c],
                                      kv_transfer_params=out.kv_transfer_params)

        def usage() -> CompletionResponse:
            return CompletionResponse(id=response_id, model=self.model_name, choices=[],
                                      usage=self.usage(choices, len(prompts), req.n))
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if continuous_usage(req):
            chunk = with_usage(chunk)
        return self.events(choices, streams, chunk, usage if include_usage else None)

    def _choice(self, req: CompletionRequest, c: Choice, prompt: list[int], text: str,
                token_ids: list[int], entries) -> CompletionChoice:
        """One choice as vLLM answers it: with echo, the prompt (its text, tokens and logprobs)
        first; with prompt_logprobs, those of every prompt token."""
        logprobs = None
        if req.echo:
            given = req.prompt if isinstance(req.prompt, str) else req.prompt[c.index // req.n]
            echoed = given if isinstance(given, str) else self.tokenizer.decode(prompt, skip_special_tokens=False)
            text = echoed + text
            if entries is not None:
                scored = c.prompt_logprobs or [None] * len(prompt)  # None: a consumer's, the proxy fills them
                logprobs = self._logprobs([_PromptToken(t, s) for t, s in zip(prompt, scored)], 0)
                more = self._logprobs(entries, sum(len(t) for t in logprobs.tokens))
                for name in ("tokens", "token_logprobs", "text_offset", "top_logprobs"):
                    getattr(logprobs, name).extend(getattr(more, name))
        elif entries is not None:
            logprobs = self._logprobs(entries, 0)
        return CompletionChoice(
            index=c.index, text=text, logprobs=logprobs, finish_reason=c.finish_reason,
            stop_reason=c.stop_reason, token_ids=token_ids if req.return_token_ids else None,
            prompt_token_ids=prompt if req.return_token_ids else None,
            prompt_logprobs=self.prompt_logprobs(c.prompt_logprobs) if req.prompt_logprobs is not None else None)

    def _logprobs(self, entries, text_offset: int) -> CompletionLogprobs:
        out = CompletionLogprobs()
        tok = self.tokenizer
        for e in entries:
            text = tok.token_text(e.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(e.logprob)
            out.text_offset.append(text_offset)
            text_offset += len(text)
            out.top_logprobs.append({tok.token_text(t): lp for t, lp in (e.top or [])}
                                    if e.top is not None else None)
        return out


class _PromptToken:
    """An echoed prompt token as a logprobs entry: the engine's score of it (its logprob, and its
    own entry among the most likely, as vLLM reports it), or None (the first token, or unknown)."""

    def __init__(self, token_id: int, scored):
        self.token_id = token_id
        self.logprob = scored.logprob if scored is not None else None
        self.top = None
        if scored is not None:
            self.top = [(token_id, scored.logprob)] + [(t, lp) for t, lp in scored.top or [] if t != token_id]
