"""Conditional disaggregation inside the proxy's flow, on fake instances (no processes): what counts
as decode's prefill queue. Streams decode is already generating are not a queue; local prefills
that have not produced their first token are."""

from __future__ import annotations

import asyncio
import json

from pdserve.health import PrefixCacheInfo
from pdserve.proxy.decision import DisaggPolicy
from pdserve.proxy.flow import PDFlow
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.router import Router
from pdserve.proxy.upstream import Reply

KV = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_block_ids": [0]}


class FakeStream:
    """A decode answer: the first event comes at once for a transferred prompt and after `gate`
    for a prompt decode prefills itself; the rest after `done`."""

    def __init__(self, first_now: bool, chat: bool, gate: asyncio.Event, done: asyncio.Event):
        self.status_code = 200
        self.first_now, self.chat, self.gate, self.done = first_now, chat, gate, done

    async def chunks(self):
        if self.chat:  # a chat stream opens with the role, before its prompt is prefilled
            yield b'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}\n\n'
        if not self.first_now:
            await self.gate.wait()
        yield b'data: {"choices": [{"text": "a"}]}\n\n'
        await self.done.wait()
        yield b"data: [DONE]\n\n"

    async def close(self) -> None:
        pass


class FakeInstance:
    def __init__(self, url: str):
        self.url = url
        self.gate, self.done = asyncio.Event(), asyncio.Event()
        self.bodies: list[dict] = []
        self.in_use = 0

    def hold(self) -> None:
        self.in_use += 1

    def unhold(self) -> None:
        self.in_use -= 1

    async def post_json(self, path, body, headers):  # a producer's answer
        self.bodies.append(body)
        return Reply(200, json.dumps({"choices": [{"text": "a", "finish_reason": None}],
                                      "kv_transfer_params": KV}).encode())

    async def open_stream(self, path, body, headers):
        self.bodies.append(body)
        return FakeStream("kv_transfer_params" in body, "messages" in body, self.gate, self.done)

    async def close(self) -> None:
        pass


class HeldIndex:
    """A KV index in which each instance caches a fixed number of the prompt's first blocks."""

    def __init__(self, blocks: dict[str, int]):
        self.blocks = blocks

    def cached_blocks(self, url: str, hashes: list[int]) -> int:
        return min(self.blocks.get(url, 0), len(hashes))

    def drop(self, url: str) -> None:
        pass

    def close(self) -> None:
        pass


class Ids:
    """Prompts tokenized as they are: a completion's prompt given as token ids."""

    def ids(self, body: dict, path: str) -> list[int]:
        return body["prompt"]


async def _never_gone() -> bool:
    return False


def test_running_streams_are_not_a_queue_but_pending_local_prefills_are():
    async def main():
        prefill, decode = FakeInstance("http://p"), FakeInstance("http://d")
        flow = PDFlow(Router([prefill], [decode]), ProxyMetrics(), protocol="pdserve",
                      policy=DisaggPolicy(local_max_tokens=256, decode_queue_max=2))
        streams = []

        async def request(n_tokens: int, i: int, chat: bool = False) -> str:
            body = {"prompt": list(range(1, n_tokens + 1)), "max_tokens": 8, "stream": True}
            if chat:
                body = {"messages": [{"role": "user", "content": "w" * 4 * n_tokens}], "stream": True}
            path = "/v1/chat/completions" if chat else "/v1/completions"
            response = await flow.handle(json.dumps(body).encode(), path, f"r{i}", _never_gone)
            it = response.body_iterator
            streams.append(asyncio.ensure_future(_drain(it)))
            await asyncio.sleep(0.01)  # the first event, if it comes at once
            return response.headers["X-PD-Decision"]

        # ten long prompts: remote, and decode generates them (their first tokens came at once)
        assert [await request(1000, i) for i in range(10)] == ["remote"] * 10
        # decode runs ten streams and prefills nothing: a short prompt is prefilled there
        assert await request(100, 10) == "local"
        assert await request(100, 11) == "local"
        assert await request(100, 12, chat=True) == "local"  # its role arrives, its token does not
        assert await request(100, 13) == "remote"  # three local prefills pending: decode is busy
        decode.gate.set()  # their first tokens come
        await asyncio.sleep(0.01)
        assert await request(100, 14) == "local"
        decode.done.set()
        await asyncio.gather(*streams)
        assert flow.router.decode.states[0].prefilling == 0
        assert flow.router.decode.states[0].outstanding == 0
    asyncio.run(asyncio.wait_for(main(), 10))


async def _drain(it) -> None:
    async for _ in it:
        pass


def test_a_prompt_the_producer_counts_otherwise_is_counted_and_said_once(tiny_model, caplog):
    """The producer's usage.prompt_tokens is the truth the proxy's ids should equal; another count
    means the proxy renders or tokenizes otherwise, and routing by blocks would miss."""
    from pdserve.proxy.prompts import PromptTokens

    class Counting(FakeInstance):
        def __init__(self, url: str):
            super().__init__(url)
            self.extra = 0  # tokens the producer counts beyond the prompt's ids

        async def post_json(self, path, body, headers):
            self.bodies.append(body)
            counted = len(body["prompt"]) + self.extra
            return Reply(200, json.dumps({"choices": [{"text": "a", "finish_reason": "stop"}],
                                          "usage": {"prompt_tokens": counted}}).encode())

    async def main():
        prefill, decode = Counting("http://p"), FakeInstance("http://d")
        metrics = ProxyMetrics()
        flow = PDFlow(Router([prefill], [decode]), metrics, protocol="pdserve",
                      prompts=PromptTokens(tiny_model))

        async def send(i: int) -> None:
            body = {"prompt": list(range(1, 41)), "max_tokens": 8}
            response = await flow.handle(json.dumps(body).encode(), "/v1/completions", f"r{i}", _never_gone)
            assert response.status_code == 200

        def mismatches() -> float:
            return metrics.registry.get_sample_value("pdserve_proxy:prompt_token_mismatches_total")

        await send(0)
        assert mismatches() == 0
        prefill.extra = 3
        await send(1)
        await send(2)
        assert mismatches() == 2
    asyncio.run(asyncio.wait_for(main(), 10))
    assert caplog.text.count("the producer counted 43") == 1


def test_a_local_prefill_claims_what_another_instance_caches():
    """kv-aware: the decode instance holding the start of a conversation prefills the rest itself
    (80 tokens once it claims the rest of the history: within the stall budget), and claims the
    history the producer caches rather than computing it (the proxy names the producer to it as a
    holder, never decode itself)."""
    async def main():
        prefill, d0, d1 = FakeInstance("http://p"), FakeInstance("http://d0"), FakeInstance("http://d1")
        for d in (d0, d1):
            d.gate.set()
            d.done.set()
        router = Router([prefill], [d0, d1], policy="kv-aware",
                        index=HeldIndex({"http://p": 15, "http://d1": 2}))  # of 20 blocks
        for s in router.prefill.states + router.decode.states:
            s.prefix_cache = PrefixCacheInfo(model_key="m", block_size=16)
            s.kv_holder = {"engine_id": s.url}
        flow = PDFlow(router, ProxyMetrics(), protocol="pdserve", prompts=Ids())
        body = {"prompt": list(range(1000, 1320)), "max_tokens": 8, "stream": True}
        response = await flow.handle(json.dumps(body).encode(), "/v1/completions", "r", _never_gone)
        await _drain(response.body_iterator)
        assert response.headers["X-PD-Decision"] == "local" and not prefill.bodies and not d0.bodies
        assert d1.bodies[-1]["kv_transfer_params"] == {"kv_holders": [{"engine_id": "http://p"}]}
    asyncio.run(asyncio.wait_for(main(), 10))
