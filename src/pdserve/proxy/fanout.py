"""Requests the proxy answers from several: a list of prompts (one P/D request per prompt, their
answers merged into one, each choice at the `index` a single instance gives it), and a prompt's
scores (vLLM's `prompt_logprobs`, echo's logprobs), which only the producer can compute, put into
decode's answer.

Proxy process (event loop). Answers are the instances' JSON, changed only where said.
"""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

from fastapi.responses import JSONResponse, Response, StreamingResponse

DONE = b"data: [DONE]"


def split_prompts(body: dict, path: str) -> list[dict] | None:
    """A completion request with a list of prompts (strings or token id lists), one body per
    prompt; None for one prompt (a string, or one list of token ids) or a chat."""
    prompt = body.get("prompt") if path.endswith("/completions") and "chat" not in path else None
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        return [{**body, "prompt": p} for p in prompt]
    return None


def num_samples(body: dict) -> int:
    """The request's `n` when it is a whole number of at least 1; anything else counts as 1 here (the
    instance refuses it with a 400 naming the field)."""
    n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1


def wants_scores(body: dict) -> bool:
    """The answer carries the prompt's logprobs (which a P/D consumer does not have)."""
    return body.get("prompt_logprobs") is not None or (bool(body.get("echo")) and body.get("logprobs") is not None)


async def events(chunks) -> AsyncIterator[bytes]:
    """Whole SSE events (without their blank line) from an instance's chunks, as they complete."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk.encode() if isinstance(chunk, str) else chunk
        *whole, buffer = buffer.split(b"\n\n")
        for event in whole:
            if event.strip():
                yield event
    if buffer.strip():
        yield buffer


def _event(body: dict) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class PromptScores:
    """The prompt's scores in a producer's answer, for a decode instance's answer to the same body:
    `prompt_logprobs`, and with echo the prompt's entries of `logprobs` (decode leaves them None)."""

    def __init__(self, producer_answer: dict, body: dict):
        first = (producer_answer.get("choices") or [{}])[0]
        self.chat = producer_answer.get("object") == "chat.completion"
        self.prompt_logprobs = producer_answer.get("prompt_logprobs") if self.chat else first.get("prompt_logprobs")
        self.wanted = body.get("prompt_logprobs") is not None
        self.echo = None
        logprobs = first.get("logprobs")
        if body.get("echo") and logprobs and not self.chat:
            n = (producer_answer.get("usage") or {}).get("prompt_tokens", 0)
            self.echo = (logprobs["token_logprobs"][:n], logprobs["top_logprobs"][:n])

    def fill(self, answer: dict) -> dict:
        if self.chat and self.wanted:
            answer["prompt_logprobs"] = self.prompt_logprobs
        for choice in answer.get("choices") or ():
            self._fill_choice(choice)
        return answer

    def _fill_choice(self, choice: dict) -> None:
        if self.wanted and not self.chat:
            choice["prompt_logprobs"] = self.prompt_logprobs
        logprobs = choice.get("logprobs")
        if self.echo is not None and logprobs:
            lps, tops = self.echo
            logprobs["token_logprobs"][:len(lps)] = lps
            logprobs["top_logprobs"][:len(tops)] = tops

    async def fill_stream(self, chunks) -> AsyncIterator[bytes]:
        """The first event of each choice carries the echoed prompt (and the prompt logprobs)."""
        seen: set[int] = set()
        async for event in events(chunks):
            body = _parse(event)
            if body is None or not body.get("choices"):
                yield event + b"\n\n"
                continue
            if self.chat and self.wanted and not seen:
                body["prompt_logprobs"] = self.prompt_logprobs
            for c in body["choices"]:
                if c.get("index") not in seen:
                    seen.add(c.get("index"))
                    self._fill_choice(c)
            yield _event(body)


def _parse(event: bytes) -> dict | None:
    if not event.startswith(b"data: ") or event.startswith(DONE):
        return None
    try:
        body = json.loads(event[6:])
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def respond(response: Response, scores: PromptScores, headers: dict) -> Response:
    """Decode's answer with the producer's prompt scores put in."""
    if isinstance(response, StreamingResponse):
        return StreamingResponse(scores.fill_stream(response.body_iterator), media_type="text/event-stream",
                                 headers=headers)
    if response.status_code != 200:
        return response
    return JSONResponse(scores.fill(json.loads(response.body)), headers=headers)


# --- a list of prompts --------------------------------------------------------------------------

def merge_answers(answers: list[dict], n: int) -> dict:
    """The answers to each prompt (n choices each) as one: choices in prompt order, usage summed."""
    merged = {**answers[0], "choices": [], "kv_transfer_params": None}
    usage: dict = {}
    for p, answer in enumerate(answers):
        merged["choices"] += [{**c, "index": p * n + c.get("index", 0)} for c in answer.get("choices") or ()]
        _add_usage(usage, answer.get("usage"))
    merged["choices"].sort(key=lambda c: c["index"])
    merged["usage"] = usage or None
    return merged


def _add_usage(total: dict, usage: dict | None) -> None:
    for key, value in (usage or {}).items():
        if isinstance(value, int):
            total[key] = total.get(key, 0) + value
        elif isinstance(value, dict):  # prompt_tokens_details
            _add_usage(total.setdefault(key, {}), value)


async def merge(responses: list[Response], n: int, body: dict, headers: dict) -> Response:
    """One response from the responses to each prompt: the first that is not a success, else
    their answers (or their streams, events interleaved as they come) merged."""
    failed = next((r for r in responses if r.status_code != 200), None)
    if failed is not None:
        discard(responses)
        return failed
    if not body.get("stream"):
        return JSONResponse(merge_answers([json.loads(r.body) for r in responses], n), headers=headers)
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    return StreamingResponse(merge_streams([r.body_iterator for r in responses], n, include_usage),
                             media_type="text/event-stream", headers=headers)


def discard(responses: list[Response]) -> None:
    """Responses nobody will send: each stream is read to its end (in a task), so its leg ends and
    gives back what it holds."""
    for r in responses:
        if isinstance(r, StreamingResponse):
            asyncio.ensure_future(_drain(r.body_iterator))


async def _drain(chunks) -> None:
    async for _ in chunks:
        pass


async def merge_streams(streams: list, n: int, include_usage: bool) -> AsyncIterator[bytes]:
    """The events of every prompt's stream with each choice's index moved to its place, the usage
    events summed into one at the end, one [DONE]."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(p: int, chunks) -> None:
        try:
            async for event in events(chunks):
                await queue.put((p, event))
        finally:
            await queue.put((p, None))

    tasks = [asyncio.ensure_future(pump(p, s)) for p, s in enumerate(streams)]
    usage: dict = {}
    last = None
    try:
        remaining = len(tasks)
        while remaining:
            p, event = await queue.get()
            if event is None:
                remaining -= 1
                continue
            body = _parse(event)
            if body is None:
                if not event.startswith(DONE):
                    yield event + b"\n\n"
                continue
            if "error" in body:
                yield _event(body)
                continue
            if not body.get("choices") and body.get("usage"):
                _add_usage(usage, body["usage"])
                last = body
                continue
            for c in body.get("choices") or ():
                c["index"] = p * n + c.get("index", 0)
            yield _event(body)
        if include_usage and last is not None:
            yield _event({**last, "usage": usage})
        yield DONE + b"\n\n"
    finally:
        for t in tasks:
            t.cancel()
