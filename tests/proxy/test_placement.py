"""Routing policies and the joint (P, D) placement, as pure logic on fake instances and a fake KV
index: round-robin ignores load, least-loaded ignores caches, kv-aware weighs what each instance
caches of the prompt against its queue; a producer counts what the chosen decode instance holds when
it can pull it; the conditional decision uses what decode lacks."""

from __future__ import annotations

from pdserve.health import PrefixCacheInfo
from pdserve.proxy.decision import KV_AWARE_POLICY, LOCAL, REMOTE
from pdserve.proxy.placement import place
from pdserve.proxy.policy import LOAD_TOKENS, order
from pdserve.proxy.prompts import block_hashes
from pdserve.proxy.router import Router

INFO = PrefixCacheInfo(model_key="m", block_size=16)
PROMPT = list(range(1000, 1320))  # 320 tokens: 20 full blocks


class FakeUpstream:
    def __init__(self, url: str):
        self.url = url


class FakeIndex:
    """url -> how many of the prompt's leading blocks it caches."""

    def __init__(self, blocks: dict[str, int]):
        self.blocks = blocks

    def cached_blocks(self, url: str, hashes: list[int]) -> int:
        assert hashes == block_hashes(PROMPT, INFO, None)
        return min(self.blocks.get(url, 0), len(hashes))

    def drop(self, url: str) -> None:
        pass

    def close(self) -> None:
        pass


def router(policy: str, cached: dict[str, int], num_prefill: int = 2, num_decode: int = 2) -> Router:
    r = Router([FakeUpstream(f"http://p{i}") for i in range(num_prefill)],
               [FakeUpstream(f"http://d{i}") for i in range(num_decode)], policy=policy, index=FakeIndex(cached))
    for s in r.prefill.states + r.decode.states:
        s.prefix_cache = INFO
    return r


def test_round_robin_takes_turns_whatever_the_load():
    r = router("round-robin", {})
    a, b = r.decode.states
    a.outstanding = 10
    assert {r.decode.ordered("round-robin")[0].url for _ in range(4)} == {"http://d0", "http://d1"}
    r.decode.mark_down(a, "gone")
    assert all(r.decode.ordered("round-robin")[0] is b for _ in range(3))


def test_kv_aware_prefers_the_cache_until_the_queue_outweighs_it():
    r = router("kv-aware", {"http://d1": 15})  # d1 caches 240 of the 320 tokens
    for _ in range(3):
        assert place(r, PROMPT).decode[0].url == "http://d1"
    d0, d1 = r.decode.states
    d1.outstanding = 240 // LOAD_TOKENS + 1  # its queue weighs more than its cache saves
    assert place(r, PROMPT).decode[0].url == "http://d0"
    assert place(router("least-loaded", {"http://d1": 15}), PROMPT).decode[0].url in ("http://d0", "http://d1")


def test_least_loaded_ignores_caches():
    r = router("least-loaded", {"http://d1": 20})
    r.decode.states[1].queued = 1
    assert all(place(r, PROMPT).decode[0].url == "http://d0" for _ in range(3))


def test_a_producer_counts_what_it_can_pull_from_the_chosen_decode():
    r = router("kv-aware", {"http://d1": 15, "http://p0": 2})
    r.prefill.states[0].outstanding = 1  # p0 caches 2 blocks but is busier than p1
    plan = place(r, PROMPT)
    assert plan.decode[0].url == "http://d1" and plan.decode_uncached == 320 - 240
    # both producers could pull d1's 240 tokens: the idle one wins
    assert plan.prefill[0].url == "http://p1"


def test_the_conditional_decision_uses_what_decode_lacks():
    assert KV_AWARE_POLICY.decide(320 - 240, 0, 0) == LOCAL  # decode lacks 80 tokens: it prefills them
    assert KV_AWARE_POLICY.decide(320, 0, 0) == REMOTE
    assert KV_AWARE_POLICY.decide(80, 3, 0) == REMOTE  # ... unless prompts already queue there


def test_without_the_prompt_kv_aware_is_least_loaded():
    r = router("kv-aware", {"http://d1": 20})
    r.decode.states[1].queued = 1
    plan = place(r, None)
    assert plan.decode[0].url == "http://d0" and plan.decode_uncached is None


def test_order_puts_healthy_instances_first_under_every_policy():
    r = router("kv-aware", {"http://d0": 20})
    r.decode.mark_down(r.decode.states[0], "gone")
    for policy in ("round-robin", "least-loaded", "kv-aware"):
        states = order(policy, r.decode.states, 0, 320, lambda s: 320 if s.url == "http://d0" else 0)
        assert states[0].url == "http://d1"
