"""The proxy counts the prompt tokens it placed by the KV index and, of those, the longest prefix
any one instance held at the time (`pdserve_proxy:prompt_tokens_cached_anywhere`): the hit rate
routing could reach at most, beside the instances' own counters."""

from __future__ import annotations

import asyncio
import json

from test_flow_decision import FakeInstance, HeldIndex, Ids, _drain, _never_gone

from pdserve.health import PrefixCacheInfo
from pdserve.proxy.flow import PDFlow
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.router import Router


def _placed(policy: str, held: dict[str, int], prompt_tokens: int) -> tuple[float, float]:
    async def main():
        prefill, decode = FakeInstance("http://p"), FakeInstance("http://d")
        decode.gate.set()
        decode.done.set()
        router = Router([prefill], [decode], policy=policy, index=HeldIndex(held))
        for s in router.prefill.states + router.decode.states:
            s.prefix_cache = PrefixCacheInfo(model_key="m", block_size=16)
        metrics = ProxyMetrics()
        flow = PDFlow(router, metrics, protocol="pdserve", prompts=Ids())
        body = {"prompt": [5] * prompt_tokens, "max_tokens": 8, "stream": True}
        response = await flow.handle(json.dumps(body).encode(), "/v1/completions", "r", _never_gone)
        await _drain(response.body_iterator)
        return metrics.prompt_tokens._value.get(), metrics.prompt_tokens_cached._value.get()
    return asyncio.run(asyncio.wait_for(main(), 10))


def test_the_longest_prefix_any_instance_holds_is_counted():
    # decode holds 2 of the prompt's 6 full blocks, the producer 3: 48 of 100 tokens were cached somewhere
    assert _placed("kv-aware", {"http://d": 2, "http://p": 3}, 100) == (100, 48)
    assert _placed("kv-aware", {}, 100) == (100, 0)


def test_policies_blind_to_the_index_count_nothing():
    assert _placed("least-loaded", {"http://d": 2}, 100) == (0, 0)
