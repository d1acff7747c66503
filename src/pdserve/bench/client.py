"""The load: requests sent to any OpenAI-compatible server at a given rate, every chunk timed.

Benchmark client process (one event loop). Arrivals follow vLLM's: with `request_rate` r and
`burstiness` b, gaps are gamma-distributed with shape b and mean 1/r (b = 1: a Poisson process);
r = inf sends everything at once. `max_concurrency` bounds requests in flight. Each request streams
(`/v1/completions` with `ignore_eos`, or `/v1/chat/completions`); its chunks' arrival times become
TTFT and ITL, the server's usage the token counts.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time

import httpx

from pdserve.bench.datasets import BenchRequest
from pdserve.bench.stats import RequestResult, chunk_times_to_result


def arrival_gaps(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait before each request (the first at once)."""
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (request_rate * burstiness)
    return [0.0] + [rng.gammavariate(burstiness, theta) for _ in range(n - 1)]


def _body(req: BenchRequest, model: str | None, chat: bool) -> dict:
    body = {"max_tokens": req.output_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    if chat:
        text = req.prompt if isinstance(req.prompt, str) else " ".join(map(str, req.prompt))
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = req.prompt
    return body


async def send(client: httpx.AsyncClient, endpoint: str, req: BenchRequest, model: str | None,
               t0: float) -> RequestResult:
    chat = "chat" in endpoint
    start = time.perf_counter()
    times, output_len, text = [], 0, []
    try:
        async with client.stream("POST", endpoint, json=_body(req, model, chat)) as r:
            if r.status_code != 200:
                detail = (await r.aread()).decode(errors="replace")[:300]
                return RequestResult(req.prompt_len, start=start - t0, error=f"{r.status_code}: {detail}")
            decision = r.headers.get("X-PD-Decision")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return RequestResult(req.prompt_len, start=start - t0, error=chunk["error"].get("message", ""))
                if chunk.get("usage"):
                    output_len = chunk["usage"].get("completion_tokens", output_len)
                choices = chunk.get("choices") or []
                if choices and not (chat and (choices[0].get("delta") or {}).get("role")):
                    times.append(now)  # a chunk per token (its text may be empty: a partial character)
                for choice in choices:
                    piece = choice.get("text") if not chat else (choice.get("delta") or {}).get("content")
                    text.append(piece or "")
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return RequestResult(req.prompt_len, start=start - t0, error=f"{type(e).__name__}: {e}")
    result = chunk_times_to_result(req.prompt_len, start, times, time.perf_counter(), output_len or len(times))
    result.start = start - t0
    result.generated_text = "".join(text)
    result.pd_decision = decision
    return result


async def run(base_url: str, endpoint: str, requests: list[BenchRequest], model: str | None = None,
              request_rate: float = math.inf, burstiness: float = 1.0, max_concurrency: int | None = None,
              seed: int = 0, api_key: str | None = None, progress: bool = True) -> tuple[list[RequestResult], float]:
    """(every request's result, in order; the run's duration in seconds)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or 1000, max_keepalive_connections=max_concurrency or 1000)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = _progress(len(requests)) if progress else None
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(600, connect=10)) as client:
        t0 = time.perf_counter()

        async def one(req: BenchRequest) -> RequestResult:
            if gate is not None:
                async with gate:
                    result = await send(client, endpoint, req, model, t0)
            else:
                result = await send(client, endpoint, req, model, t0)
            if bar is not None:
                bar.update(1)
            return result
        tasks = []
        for gap, req in zip(arrival_gaps(len(requests), request_rate, burstiness, seed), requests):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.ensure_future(one(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return list(results), duration


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="req", leave=False)
