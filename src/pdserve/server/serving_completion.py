"""`POST /v1/completions`. Server process, event loop."""

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
        if req.echo or req.suffix:
            raise InvalidRequestError("echo" if req.echo else "suffix", "is not supported")
        prompts = await asyncio.to_thread(self.prompts, req)  # tokenizing never blocks the event loop
        params = self.sampling_params(req, req.max_tokens, req.logprobs)
        kv = self.transfer_params(req, len(prompts))
        choices, streams = await self.start(request_id, prompts, params, kv, req.cache_salt)
        response_id = f"cmpl-{request_id}"
        if req.stream:
            return StreamingResponse(self._stream(req, response_id, choices, streams, len(prompts)),
                                     media_type="text/event-stream")
        await self.collect(raw_request, choices, streams)
        body = CompletionResponse(
            id=response_id, model=self.model_name,
            choices=[CompletionChoice(index=c.index, text=c.text,
                                      logprobs=self._logprobs(c.logprobs, 0) if params.logprobs is not None else None,
                                      finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                      token_ids=c.token_ids if req.return_token_ids else None,
                                      prompt_token_ids=prompts[c.index // req.n] if req.return_token_ids
                                      else None)
                     for c in choices],
            usage=self.usage(choices, len(prompts), req.n),
            kv_transfer_params=choices[0].kv_transfer_params if len(choices) == 1 else None)
        return JSONResponse(body.model_dump())

    def _stream(self, req: CompletionRequest, response_id: str, choices: list[Choice], streams,
                num_prompts: int):
        offsets = {c.index: 0 for c in choices}

        def chunk(choice: Choice, out) -> CompletionResponse:
            logprobs = None
            if out.new_logprobs is not None:
                logprobs = self._logprobs(out.new_logprobs, offsets[choice.index])
            offsets[choice.index] += len(out.new_text)
            return CompletionResponse(
                id=response_id, model=self.model_name,
                choices=[CompletionChoice(index=choice.index, text=out.new_text, logprobs=logprobs,
                                          finish_reason=out.finish_reason, stop_reason=out.stop_reason,
                                          token_ids=out.new_token_ids if req.return_token_ids else None)],
                kv_transfer_params=out.kv_transfer_params)

        def usage() -> CompletionResponse:
            return CompletionResponse(id=response_id, model=self.model_name, choices=[],
                                      usage=self.usage(choices, num_prompts, req.n))
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if continuous_usage(req):
            chunk = with_usage(chunk)
        return self.events(choices, streams, chunk, usage if include_usage else None)

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
