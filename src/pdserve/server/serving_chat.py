"""`POST /v1/chat/completions`: the tokenizer's chat template, then the same engine path.
Server process, event loop."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.http.errors import APIError
from pdserve.sampling_params import InvalidRequestError
from pdserve.server.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                                     ChatCompletionResponse, ChatLogprobs, ChatResponseMessage,
                                     ChatStreamChoice, ChatTokenLogprob, ChatTopLogprob,
                                     DeltaMessage)
from pdserve.server.serving import (MAX_CHARS_PER_TOKEN, BaseServing, Choice, continuous_usage, running_usage,
                                    sse, with_usage)
from pdserve.server.tools import ToolPolicy, ToolRequest
from pdserve.text.chat_template import ChatTemplateError
from pdserve.text.prompts import PromptError, chat_messages, chat_prompt_ids
from pdserve.text.template_sandbox import TemplateBusyError, TemplateSandbox


class ChatServing(BaseServing):
    def __init__(self, *args, trust_request_chat_template: bool = False, tool_policy: ToolPolicy = ToolPolicy(),
                 **kwargs):
        """Templates requests bring are refused (vLLM's rule) unless trusted; trusted ones render
        in a sandbox process, bounded in time, memory and output (docs/design.md, "Checkpoints and chat")."""
        super().__init__(*args, **kwargs)
        self.sandbox = TemplateSandbox() if trust_request_chat_template else None
        self.tool_policy = tool_policy

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()

    def prompt(self, req: ChatCompletionRequest, tools: list[dict] | None = None) -> list[int]:
        if req.chat_template is not None and self.sandbox is None:
            raise InvalidRequestError("chat_template", "this server does not render chat templates sent with "
                                                       "requests; start it with --trust-request-chat-template "
                                                       "to allow them")
        try:
            messages = chat_messages([{**(m.model_extra or {}), "role": m.role, "content": m.content}
                                      for m in req.messages])
        except PromptError as e:
            raise InvalidRequestError(e.field, str(e)) from None
        try:
            text = self.tokenizer.apply_chat_template(
                messages, req.add_generation_prompt, continue_final_message=req.continue_final_message,
                chat_template=req.chat_template, template_kwargs=req.chat_template_kwargs,
                max_chars=self.engine.engine.max_model_len * MAX_CHARS_PER_TOKEN, sandbox=self.sandbox,
                tools=tools)
        except ChatTemplateError as e:
            raise InvalidRequestError(e.field, f"the chat template failed: {e}") from None
        except TemplateBusyError as e:
            raise APIError(503, f"overloaded: {e}", headers={"Retry-After": "1"}) from None
        self.check_length(text, "messages")
        return chat_prompt_ids(self.tokenizer, text)

    async def create(self, req: ChatCompletionRequest, request_id: str, raw_request):
        self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidRequestError("top_logprobs", "requires logprobs to be true")
        tools = ToolRequest(req, self.tool_policy)
        prompt = await asyncio.to_thread(self.prompt, req, tools.template_tools)  # never blocks the loop
        prompt = self.truncated(req, prompt)
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self.sampling_params(req, max_tokens, num_logprobs)
        if tools.constraint() is not None:  # required / named: forced through the grammar
            params = replace(params, structured=tools.constraint())
        kv = self.transfer_params(req, 1)
        choices, streams = await self.start(request_id, [prompt], params, kv, req.cache_salt)
        response_id = f"chatcmpl-{request_id}"
        if req.stream:
            return StreamingResponse(self._stream(req, response_id, choices, streams, len(prompt), tools),
                                     media_type="text/event-stream")
        await self.collect(raw_request, choices, streams)
        body = ChatCompletionResponse(
            id=response_id, model=self.model_name,
            choices=[self._choice(req, tools, c) for c in choices],
            usage=self.usage(choices, 1, req.n),
            kv_transfer_params=choices[0].kv_transfer_params if len(choices) == 1 else None,
            prompt_token_ids=prompt if req.return_token_ids else None,
            prompt_logprobs=self.prompt_logprobs(choices[0].prompt_logprobs)
            if req.prompt_logprobs is not None else None)
        return JSONResponse(body.model_dump())

    def _choice(self, req: ChatCompletionRequest, tools: ToolRequest, c: Choice) -> ChatChoice:
        message = _message(tools, c.text)  # the answer read once: its calls decide the finish reason too
        return ChatChoice(index=c.index, message=message,
                          logprobs=self._logprobs(c.logprobs) if req.logprobs else None,
                          finish_reason=_finish_reason(tools, bool(message.tool_calls), c.finish_reason),
                          stop_reason=c.stop_reason, token_ids=c.token_ids if req.return_token_ids else None)

    async def _stream(self, req: ChatCompletionRequest, response_id: str, choices: list[Choice],
                      streams, num_prompt_tokens: int, tools: ToolRequest):
        tool_streams = {c.index: tools.stream() for c in choices}

        def chunk(choice: Choice, out) -> ChatCompletionChunk:
            logprobs = self._logprobs(out.new_logprobs) if out.new_logprobs is not None else None
            ts = tool_streams[choice.index]
            content, calls = ts.feed(out.new_text, out.finished)
            finish = _finish_reason(tools, ts.called, out.finish_reason) if out.finished else out.finish_reason
            return ChatCompletionChunk(
                id=response_id, model=self.model_name,
                choices=[ChatStreamChoice(index=choice.index, delta=DeltaMessage(content=content, tool_calls=calls),
                                          logprobs=logprobs, finish_reason=finish,
                                          stop_reason=out.stop_reason,
                                          token_ids=out.new_token_ids if req.return_token_ids else None)],
                kv_transfer_params=out.kv_transfer_params)

        def usage() -> ChatCompletionChunk:
            return ChatCompletionChunk(id=response_id, model=self.model_name, choices=[],
                                       usage=self.usage(choices, 1, req.n))
        continuous = continuous_usage(req)
        for c in choices:  # the role comes first, as OpenAI streams it
            yield sse(ChatCompletionChunk(id=response_id, model=self.model_name, choices=[
                ChatStreamChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))],
                usage=running_usage(num_prompt_tokens, 0) if continuous else None))
        if continuous:
            chunk = with_usage(chunk)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        async for event in self.events(choices, streams, chunk, usage if include_usage else None):
            yield event

    def _logprobs(self, entries) -> ChatLogprobs:
        tok = self.tokenizer
        content = []
        for e in entries:
            text = tok.token_text(e.token_id)
            tops = [ChatTopLogprob(token=tok.token_text(t), logprob=lp,
                                   bytes=list(tok.token_text(t).encode()))
                    for t, lp in (e.top or [])]
            content.append(ChatTokenLogprob(token=text, logprob=e.logprob, bytes=list(text.encode()),
                                            top_logprobs=tops))
        return ChatLogprobs(content=content)

def _message(tools: ToolRequest, text: str) -> ChatResponseMessage:
    content, calls = tools.answer(text)
    return ChatResponseMessage(content=content if calls else text, tool_calls=calls or [])


def _finish_reason(tools: ToolRequest, called: bool, reason: str | None) -> str | None:
    """vLLM's: "tool_calls" when auto or required produced calls; a named function keeps its own."""
    if tools.mode in ("auto", "required") and reason == "stop" and called:
        return "tool_calls"
    return reason
