"""What the proxy counts as a producer's queue while a request is there (Legs.count): the prompt
tokens its placement said that producer computes, from when it is sent until the producer answers,
and nothing after, whether the producer took it, refused it (503) or failed."""

from __future__ import annotations

import asyncio
import json

from test_flow_decision import FakeInstance, HeldIndex, Ids, _drain, _never_gone

from pdserve.health import PrefixCacheInfo
from pdserve.proxy.flow import PDFlow
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.placement import REQUEST_TOKENS
from pdserve.proxy.router import Router
from pdserve.proxy.upstream import Reply


class SlowProducer(FakeInstance):
    """Answers once `release` is set, with `status` (200: the hand-off)."""

    def __init__(self, url: str, status: int = 200):
        super().__init__(url)
        self.release, self.status, self.calls = asyncio.Event(), status, 0

    async def post_json(self, path, body, headers):
        self.calls += 1
        await self.release.wait()
        if self.status != 200:
            return Reply(self.status, b'{"error": {"message": "busy"}}')
        return await super().post_json(path, body, headers)


def _flow(producers: list[FakeInstance], cached: dict[str, int]) -> tuple[PDFlow, FakeInstance]:
    decode = FakeInstance("http://d")
    decode.gate.set()
    decode.done.set()
    router = Router(producers, [decode], policy="kv-aware", index=HeldIndex(cached))
    for s in router.prefill.states + router.decode.states:
        s.prefix_cache = PrefixCacheInfo(model_key="m", block_size=16)
    return PDFlow(router, ProxyMetrics(), protocol="pdserve", prompts=Ids()), decode


async def _request(flow: PDFlow, tokens: int) -> str:
    body = {"prompt": [7] * tokens, "max_tokens": 4, "stream": True}
    response = await flow.handle(json.dumps(body).encode(), "/v1/completions", "r", _never_gone)
    await _drain(response.body_iterator)
    return response.headers["X-PD-Decision"]


def test_a_producer_counts_the_tokens_it_computes_while_the_request_is_there():
    async def main():
        producer = SlowProducer("http://p")
        flow, _ = _flow([producer], {"http://p": 2})  # it caches 32 of the 96 tokens
        (state,) = flow.router.prefill.states
        task = asyncio.ensure_future(_request(flow, 96))
        await asyncio.sleep(0.05)
        assert state.outstanding == 1 and state.pending_tokens == 64 + REQUEST_TOKENS
        producer.release.set()
        assert await task == "remote"
        assert state.outstanding == 0 and state.pending_tokens == 0
    asyncio.run(asyncio.wait_for(main(), 10))


def test_a_refusing_producer_keeps_nothing_counted():
    async def main():
        busy, free = SlowProducer("http://p0", status=503), SlowProducer("http://p1")
        busy.release.set()
        flow, _ = _flow([busy, free], {"http://p0": 6})  # p0 caches most: tried first, refuses
        p0, p1 = flow.router.prefill.states
        task = asyncio.ensure_future(_request(flow, 96))
        await asyncio.sleep(0.05)
        assert p0.pending_tokens == 0 and p1.pending_tokens > 0  # p1 pulls p0's blocks: computes the rest
        assert busy.calls == 1 and p0.outstanding == 0 and p1.outstanding == 1
        free.release.set()
        await task
        assert (p0.pending_tokens, p1.pending_tokens, p0.outstanding, p1.outstanding) == (0, 0, 0, 0)
    asyncio.run(asyncio.wait_for(main(), 10))
