"""Routing policies and the joint (P, D) placement, as pure logic on fake instances and a fake KV
index: round-robin ignores load, least-loaded ignores caches, kv-aware weighs what each instance
caches of the prompt against its queue; a producer counts what the chosen decode instance holds when
it can pull it; the conditional decision uses what decode lacks."""

from __future__ import annotations

from pdserve.health import PrefixCacheInfo
from pdserve.proxy.placement import place
from pdserve.proxy.policy import order
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


def test_a_decode_instance_holding_most_of_the_prompt_prefills_the_rest_itself():
    r = router("kv-aware", {"http://d1": 15})  # d1 caches 240 of the 320 tokens
    for i in range(3):  # arrivals a minute apart: nothing placed earlier is still being computed
        plan = place(r, PROMPT, now=60.0 * i)
        assert plan.decode[0].url == "http://d1" and plan.decode_uncached == 80 and plan.local


def test_a_busy_holder_decodes_nothing_more_but_its_cache_is_still_pulled():
    r = router("kv-aware", {"http://d1": 15})
    r.decode.states[1].outstanding = 20  # twenty streams: a local prefill would wait behind them
    plan = place(r, PROMPT)
    assert plan.decode[0].url == "http://d0" and not plan.local
    assert plan.holders[0].url == "http://d1"  # the producer claims d1's 240 tokens first


def test_cold_prompts_go_to_a_producer_and_spread_over_decode():
    r = router("kv-aware", {})
    firsts = set()
    for _ in range(4):
        plan = place(r, PROMPT)
        assert not plan.local and plan.decode_uncached == 320
        firsts.add(plan.decode[0].url)
    assert firsts == {"http://d0", "http://d1"}  # equals take turns


def test_a_local_prefill_is_only_as_long_as_the_stall_budget():
    r = router("kv-aware", {"http://d1": 4})  # d1 holds 64 tokens: 256 left, 0.26 s at 1,000 tok/s
    r.decode.states[1].outstanding = 1  # one stream there would stall that long
    assert not place(r, PROMPT, now=0.0).local
    r.decode.states[1].prefill_tokens_per_s = 4000.0  # measured fast enough: 64 ms
    assert place(r, PROMPT, now=60.0).local


def test_a_decode_instance_running_no_stream_prefills_a_long_rest_itself_while_producers_are_busy():
    """Nothing of d1's stalls however long the prefill: it takes the turn off the producers."""
    r = router("kv-aware", {"http://d1": 4})  # 256 tokens left: 0.26 s, past the stall budget
    assert not place(r, PROMPT, now=0.0).local  # an idle producer: the turn stays with producers
    r.prefill.states[0].outstanding = 1
    assert not place(r, PROMPT, now=60.0).local  # one of them still idle
    r.prefill.states[1].queued = 2
    plan = place(r, PROMPT, now=120.0)
    assert plan.decode[0].url == "http://d1" and plan.local and plan.decode_uncached == 256


def test_an_idle_decode_instance_takes_a_new_prompt_off_busy_producers():
    """Nothing cached anywhere: while a producer is idle the prompt goes there; once every producer
    has work, a decode instance running no stream prefills it itself (a spare producer)."""
    r = router("kv-aware", {})
    r.decode.states[1].outstanding = 1
    r.prefill.states[0].outstanding = 1
    assert not place(r, PROMPT, now=0.0).local  # p1 idle
    r.prefill.states[1].queued = 1
    plan = place(r, PROMPT, now=60.0)
    assert plan.local and plan.decode[0].url == "http://d0" and plan.decode_uncached == 320
    r.decode.states[0].outstanding = 1  # a stream there: 0.32 s is past what it may wait
    assert not place(r, PROMPT, now=120.0).local


def test_a_stall_past_the_budget_is_taken_when_the_producers_queue_costs_the_turn_more_than_the_streams_lose():
    """d1 lacks 176 tokens: 0.176 s that its two streams would each wait, 0.35 s in all."""
    r = router("kv-aware", {"http://d1": 9})
    for d in r.decode.states:  # d0 runs streams too: it is no spare producer
        d.outstanding = 2
    r.prefill.states[0].outstanding = 1
    assert not place(r, PROMPT, now=0.0).local  # p1 idle: the turn waits for nothing there
    r.prefill.states[1].outstanding = 1
    assert not place(r, PROMPT, now=60.0).local  # a request ahead of it: 0.2 s saved, under 0.35 s lost
    for p in r.prefill.states:
        p.queued = 3  # four ahead: the turn would wait a second for a producer
    plan = place(r, PROMPT, now=120.0)
    assert plan.local and plan.decode[0].url == "http://d1" and plan.decode_uncached == 176


def test_a_decode_instance_splitting_its_prefills_takes_a_turn_longer_than_the_budget_in_steps():
    """d1 lacks 240 tokens: 0.24 s, held at once past the 0.1 s budget, or in three steps of 0.08 s."""
    r = router("kv-aware", {"http://d1": 5})
    d0, d1 = r.decode.states
    d0.outstanding = 1
    d1.outstanding, d1.decode_step_s = 1, 0.005  # one stream on each; d1's steps take 5 ms
    assert not place(r, PROMPT, now=0.0).local  # producers idle: no stall past the budget
    d1.max_prefill_stall_s = 0.1  # as `pdserve up` starts decode instances: in 0.1 s steps
    plan = place(r, PROMPT, now=60.0)
    assert plan.local and plan.decode[0].url == "http://d1" and plan.decode_uncached == 240
    assert plan.predicted["local_s"] == round(0.032 + 0.24 + 2 * 0.005, 4)  # its stream, the prefill, two more steps
    d0.outstanding = d1.outstanding = 0  # no stream: nothing to split it for, a producer is idle
    assert not place(r, PROMPT, now=120.0).local


def test_a_decode_instance_splitting_its_prefills_still_takes_none_past_the_most_a_stream_may_wait_all_told():
    r = router("kv-aware", {"http://d1": 2})  # 288 tokens left: 0.288 s in all
    d1 = r.decode.states[1]
    d1.outstanding, d1.max_prefill_stall_s = 1, 0.1
    assert not place(r, PROMPT).local


def test_a_claim_from_a_decode_instance_waits_for_its_step():
    r = router("kv-aware", {"http://d1": 15})
    d1 = r.decode.states[1]
    d1.outstanding = 20  # busy: the turn goes to a producer, which claims d1's 240 tokens
    before = place(r, PROMPT, now=0.0).predicted["remote_s"]
    d1.decode_step_s = 0.3
    plan = place(r, PROMPT, now=60.0)
    assert not plan.local and plan.holders[0] is d1
    assert plan.predicted["remote_s"] == round(before + 0.3, 4)


def test_no_stall_past_the_most_a_stream_may_wait_however_long_the_producers_queue():
    r = router("kv-aware", {"http://d1": 4})  # 256 tokens left: 0.256 s for d1's stream
    for d in r.decode.states:  # and 320 for d0's
        d.outstanding = 1
    for p in r.prefill.states:
        p.queued = 20
    plan = place(r, PROMPT)
    assert not plan.local and plan.predicted["remote_s"] > 5
    for d in r.decode.states:  # split into steps of 0.1 s, it would still hold them 0.256 s in all
        d.max_prefill_stall_s = 0.1
    assert not place(r, PROMPT, now=60.0).local


def test_a_local_prefill_counts_what_decode_can_claim_from_another_instance():
    r = router("kv-aware", {"http://p0": 15, "http://d1": 2})  # d1 holds 32 tokens, p0 240
    for d in r.decode.states:  # a stream on each: on d1, 80 tokens to compute stall it 80 ms, 288 would 288
        d.outstanding = 1
    plan = place(r, PROMPT)
    assert plan.local and plan.decode[0].url == "http://d1"
    assert [s.url for s in plan.holders] == ["http://p0"]  # d1 claims p0's 240 tokens, never its own


def test_another_proxys_streams_on_a_decode_instance_stall_too():
    r = router("kv-aware", {"http://d1": 4})
    for p in r.prefill.states:
        p.outstanding = 1
    r.decode.states[0].outstanding = 1  # no spare producer either
    r.decode.states[1].others_running = 2  # its last report: two running that this proxy did not send
    assert not place(r, PROMPT, now=0.0).local


def test_a_local_prefill_under_way_keeps_the_next_long_one_off_that_instance():
    r = router("kv-aware", {"http://d1": 4})
    for p in r.prefill.states:
        p.outstanding = 1
    r.decode.states[0].outstanding = 1  # d0 runs a stream: no spare producer for the whole prompt
    first = place(r, PROMPT, now=0.0)
    assert first.local
    first.decode[0].outstanding += 1  # the flow counts it while it runs (a minute on: another turn)
    assert not place(r, PROMPT, now=60.0).local


def test_least_loaded_ignores_caches():
    r = router("least-loaded", {"http://d1": 20})
    r.decode.states[1].queued = 1
    assert all(place(r, PROMPT).decode[0].url == "http://d0" for _ in range(3))


def test_a_producer_counts_what_it_can_pull_from_decode():
    r = router("kv-aware", {"http://d1": 15, "http://p0": 2})
    r.decode.states[1].outstanding = 20
    r.prefill.states[0].outstanding = 1  # p0 caches 2 blocks of its own but is busy
    plan = place(r, PROMPT)
    assert plan.prefill[0].url == "http://p1"  # idle, and it can pull d1's 240 tokens too
    r.prefill.states[0].outstanding = 0
    assert place(r, PROMPT).prefill[0].url in ("http://p0", "http://p1")  # equal: both pull


def test_without_the_prompt_kv_aware_is_least_loaded():
    r = router("kv-aware", {"http://d1": 20})
    r.decode.states[1].queued = 1
    plan = place(r, None)
    assert plan.decode[0].url == "http://d0" and plan.decode_uncached is None and not plan.local


def test_healthy_instances_come_first_under_every_policy():
    r = router("kv-aware", {"http://d0": 20})  # d0 caches the whole prompt, but is down
    r.decode.mark_down(r.decode.states[0], "gone")
    for policy in ("round-robin", "least-loaded"):
        assert order(policy, r.decode.states, 0)[0].url == "http://d1"
    plan = place(r, PROMPT)
    assert plan.decode[0].url == "http://d1" and "http://d0" not in [s.url for s in plan.holders]


def test_a_producer_pulls_what_another_producer_caches_so_the_idle_one_is_chosen():
    r = router("kv-aware", {"http://p0": 15})  # p0 computed this prompt's 240 leading tokens
    r.prefill.states[0].outstanding = 2  # and is busy now
    plan = place(r, PROMPT)
    assert plan.prefill[0].url == "http://p1"  # idle: it pulls p0's blocks instead of computing them
    assert plan.holders[0].url == "http://p0"  # named to p1 as the holder to claim them from


def test_the_chosen_producer_is_not_named_a_holder_to_itself():
    r = router("kv-aware", {"http://p0": 15, "http://d1": 10})
    r.decode.states[1].prefilling = 1  # d1 has a prompt of its own to prefill: this one goes to a producer
    for _ in range(2):  # equal producers take turns: each is chosen once
        plan = place(r, PROMPT)
        best = ["http://d1"] if plan.prefill[0].url == "http://p0" else ["http://p0", "http://d1"]
        assert plan.prefill[0] not in plan.holders and [s.url for s in plan.holders][:len(best)] == best


def test_producers_share_requests_when_one_of_them_caches_the_shared_prefix():
    r = router("kv-aware", {"http://p0": 8}, num_prefill=4)  # p0 holds a system prompt every request shares
    chosen = []
    for _ in range(8):  # requests arriving together: each waits until its first token
        plan = place(r, PROMPT)
        plan.prefill[0].outstanding += 1
        chosen.append(plan.prefill[0].url)
    assert {u: chosen.count(u) for u in set(chosen)} == {f"http://p{i}": 2 for i in range(4)}


def test_siblings_arriving_together_go_where_their_shared_prefix_is_being_computed():
    r = router("kv-aware", {}, num_prefill=4)  # nobody caches the prompt yet
    first = place(r, PROMPT, now=100.0)
    first.prefill[0].outstanding += 1  # its prefill is under way there
    for _ in range(3):  # siblings with the same prompt, before the index knows of it
        plan = place(r, PROMPT, now=100.1)
        assert plan.prefill[0] is first.prefill[0]
        assert first.prefill[0] not in plan.holders  # blocks being computed cannot be claimed yet


def test_what_an_instance_is_computing_is_forgotten_once_it_should_be_done():
    r = router("kv-aware", {}, num_prefill=4)
    first = place(r, PROMPT, now=100.0)
    later = place(r, PROMPT, now=130.0)  # long after: if it were cached, the index would say so
    assert later.prefill[0] is not first.prefill[0]  # equals take turns again


def test_instances_whose_predicted_times_differ_by_noise_take_turns():
    r = router("kv-aware", {}, num_prefill=4)
    for i, s in enumerate(r.prefill.states + r.decode.states):  # measured rates differ by up to 40 %
        s.prefill_tokens_per_s = 1000.0 + 60 * i
    producers, decoders = set(), set()
    for i in range(8):  # one at a time, each done before the next (a minute apart)
        plan = place(r, PROMPT, now=60.0 * i)
        producers.add(plan.prefill[0].url)
        decoders.add(plan.decode[0].url)
    assert len(producers) == 4 and len(decoders) == 2


def test_an_instance_measured_several_times_faster_draws_the_work():
    r = router("kv-aware", {}, num_prefill=3)
    for s in r.prefill.states:
        s.prefill_tokens_per_s = 1000.0
    r.prefill.states[2].prefill_tokens_per_s = 3000.0  # other hardware, not noise
    assert {place(r, PROMPT, now=60.0 * i).prefill[0].url for i in range(4)} == {"http://p2"}


def test_a_prompt_shorter_than_a_block_is_placed():
    """No full block, no hashes: nothing is cached anywhere (the proxy answered 500 to short chats)."""
    r = router("kv-aware", {})
    plan = place(r, PROMPT[:5])
    assert not plan.local and plan.decode_uncached == 5


def test_among_equals_a_history_stays_on_the_instances_that_hold_it():
    """p0 could pull p1's 128 tokens and d0 read them from the producer about as fast as d1 has them:
    equal predicted times, but the instances holding the history go first, every time, rather than
    a copy of it moving to (and being kept on) the next instance in turn."""
    r = router("kv-aware", {"http://p1": 8, "http://d1": 8})
    for d in r.decode.states:  # each runs a stream: d1 would stall it prefilling 192 tokens itself
        d.outstanding = 1
    for i in range(4):
        plan = place(r, PROMPT, now=60.0 * i)
        assert (plan.prefill[0].url, plan.decode[0].url, plan.local) == ("http://p1", "http://d1", False)
