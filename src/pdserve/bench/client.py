"""The load: requests sent to any OpenAI-compatible server at a given rate, every chunk timed.

Benchmark client process (one event loop). Arrivals follow vLLM's: with `request_rate` r and
`burstiness` b, gaps between session starts are gamma-distributed with shape b and mean 1/r (b = 1:
a Poisson process); r = inf starts everything at once; a request with an `arrival_s` (a trace) is
sent at that time instead. A session's requests go one after another (a single request is a session
of one): each waits for the previous answer, then its think time; a multi-turn request's prompt is
the previous prompt, the previous answer's token ids (`return_token_ids`) and its own new tokens.
Sessions run concurrently; `max_concurrency` bounds requests in flight. Each request streams
(`/v1/completions` with `ignore_eos`, or `/v1/chat/completions`); its chunks' arrival times become
TTFT and ITL, the server's usage the token counts.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Sequence

import httpx

from pdserve.bench.datasets import BenchRequest
from pdserve.bench.lru_bound import LRUBound
from pdserve.bench.stats import RequestResult, chunk_times_to_result
from pdserve.bench.trace import BlockPrompt


def arrival_gaps(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait before each request (the first at once)."""
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (request_rate * burstiness)
    return [0.0] + [rng.gammavariate(burstiness, theta) for _ in range(n - 1)]


def sessions(requests: list[BenchRequest]) -> list[list[int]]:
    """Indices of the requests, grouped by session in order of first appearance."""
    groups: dict[object, list[int]] = {}
    for i, req in enumerate(requests):
        groups.setdefault(req.session_id if req.session_id is not None else ("alone", i), []).append(i)
    return list(groups.values())


def session_starts(requests: list[BenchRequest], groups: list[list[int]], request_rate: float,
                   burstiness: float, seed: int) -> list[float]:
    """Seconds into the run at which each session begins: its first request's arrival, else the
    rate's schedule."""
    t, out = 0.0, []
    for gap, group in zip(arrival_gaps(len(groups), request_rate, burstiness, seed), groups):
        t += gap
        first = requests[group[0]].arrival_s
        out.append(t if first is None else first)
    return out


def _body(prompt: list[int] | str, output_len: int, model: str | None, chat: bool, token_ids: bool) -> dict:
    body = {"max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    if token_ids:
        body["return_token_ids"] = True
    if chat:
        text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = prompt
    return body


async def send(client: httpx.AsyncClient, endpoint: str, prompt: list[int] | str, output_len: int,
               model: str | None, t0: float, token_ids: bool = False) -> tuple[RequestResult, list[int]]:
    """(the request's result, its answer's token ids if asked for)."""
    chat = "chat" in endpoint
    prompt_len = len(prompt) if isinstance(prompt, list) else max(1, len(prompt) // 4)
    start = time.perf_counter()
    times, output_tokens, text, ids, cached = [], 0, [], [], None
    try:
        async with client.stream("POST", endpoint, json=_body(prompt, output_len, model, chat, token_ids)) as r:
            if r.status_code != 200:
                detail = (await r.aread()).decode(errors="replace")[:300]
                return RequestResult(prompt_len, start=start - t0, error=f"{r.status_code}: {detail}"), []
            decision = r.headers.get("X-PD-Decision")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"].get("message", "")
                    return RequestResult(prompt_len, start=start - t0, error=error), []
                if chunk.get("usage"):
                    output_tokens = chunk["usage"].get("completion_tokens", output_tokens)
                    cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", cached)
                choices = chunk.get("choices") or []
                if choices and not (chat and (choices[0].get("delta") or {}).get("role")):
                    times.append(now)  # a chunk per token (its text may be empty: a partial character)
                for choice in choices:
                    piece = choice.get("text") if not chat else (choice.get("delta") or {}).get("content")
                    text.append(piece or "")
                    ids.extend(choice.get("token_ids") or ())
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return RequestResult(prompt_len, start=start - t0, error=f"{type(e).__name__}: {e}"), []
    if token_ids and not ids and (output_tokens or times):
        return RequestResult(prompt_len, start=start - t0, error="the answer has no token ids: a multi-turn "
                             "history needs a server that supports return_token_ids"), []
    result = chunk_times_to_result(prompt_len, start, times, time.perf_counter(), output_tokens or len(times))
    result.start = start - t0
    result.generated_text = "".join(text)
    result.pd_decision = decision
    result.cached_tokens = cached
    return result, ids


def prompt_of(req: BenchRequest) -> list[int] | str:
    return req.prompt.ids() if isinstance(req.prompt, BlockPrompt) else req.prompt


async def run(base_url: str, endpoint: str, requests: list[BenchRequest], model: str | None = None,
              request_rate: float = math.inf, burstiness: float = 1.0, max_concurrency: int | None = None,
              seed: int = 0, api_key: str | None = None, progress: bool = True,
              bounds: Sequence[LRUBound] = (), transport: httpx.AsyncBaseTransport | None = None,
              ) -> tuple[list[RequestResult], float]:
    """(every request's result, in the order given; the run's duration in seconds). `bounds` see
    each token-id prompt in the order sent, and each multi-turn answer."""
    if "chat" in endpoint and any(r.with_history for r in requests):
        raise ValueError("multi-turn sends token-id prompts with their history: use --endpoint /v1/completions")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or 1000, max_keepalive_connections=max_concurrency or 1000)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = _progress(len(requests)) if progress else None
    groups = sessions(requests)
    starts = session_starts(requests, groups, request_rate, burstiness, seed)
    results: list[RequestResult | None] = [None] * len(requests)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits, transport=transport,
                                 timeout=httpx.Timeout(600, connect=10)) as client:
        t0 = time.perf_counter()

        async def one(prompt, req: BenchRequest, token_ids: bool) -> tuple[RequestResult, list[int]]:
            if gate is None:
                return await send(client, endpoint, prompt, req.output_len, model, t0, token_ids)
            async with gate:
                return await send(client, endpoint, prompt, req.output_len, model, t0, token_ids)

        async def session(group: list[int]) -> None:
            history: list[int] = []
            failed = None
            token_ids = any(requests[i].with_history for i in group)
            for turn, i in enumerate(group):
                req = requests[i]
                await _sleep_until(t0 + (req.arrival_s or 0.0))
                await asyncio.sleep(req.think_time_s)
                if failed is not None and req.with_history:
                    results[i] = RequestResult(req.prompt_len, error=f"not sent: turn {failed} of its session failed")
                else:
                    prompt = prompt_of(req)
                    prompt = history + prompt if req.with_history else prompt
                    for bound in bounds if isinstance(prompt, list) and "chat" not in endpoint else ():
                        bound.lookup(prompt)
                    results[i], answer = await one(prompt, req, token_ids)
                    if results[i].success and token_ids:
                        history = prompt + answer
                        for bound in bounds:
                            bound.store(history[:-1])  # the last token was never computed
                    elif not results[i].success and failed is None:
                        failed = turn
                if req.session_id is not None:
                    results[i].session_id, results[i].turn = req.session_id, turn
                if bar is not None:
                    bar.update(1)

        tasks = []
        for start, group in sorted(zip(starts, groups), key=lambda x: x[0]):
            await _sleep_until(t0 + start)
            tasks.append(asyncio.ensure_future(session(group)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return list(results), duration


async def _sleep_until(when: float) -> None:
    delay = when - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="req", leave=False)
