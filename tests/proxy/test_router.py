"""The router's choice, as pure logic: healthy before down, least loaded first (this proxy's
outstanding requests plus the queue the instance reports), equals taking turns."""

from __future__ import annotations

import asyncio

from pdserve.health import Health, Load
from pdserve.proxy.router import Pool


class FakeUpstream:
    def __init__(self, url: str):
        self.url = url


def pool(n: int = 3) -> Pool:
    return Pool("prefill", [FakeUpstream(f"http://i{k}") for k in range(n)])


def test_equals_take_turns():
    p = pool()
    firsts = [p.candidates()[0].url for _ in range(6)]
    assert sorted(set(firsts)) == ["http://i0", "http://i1", "http://i2"]


def test_down_instances_come_last_and_load_orders_the_rest():
    p = pool()
    a, b, c = p.states
    p.mark_down(a, "refused")
    b.outstanding, b.queued = 2, 3
    c.queued = 1
    for _ in range(3):
        assert [s.url for s in p.candidates()] == ["http://i2", "http://i1", "http://i0"]
    c.kv_usage, b.outstanding, b.queued = 0.9, 0, 1  # equal queue: less KV in use wins
    assert p.candidates()[0] is b


def test_members_change_at_run_time_and_known_ones_keep_their_state():
    p = pool(2)
    a, b = p.states
    a.outstanding, b.healthy = 1, False
    built = []

    def make(url):
        built.append(url)
        return FakeUpstream(url)
    left = p.set_members(["http://i1", "http://i9"], make)
    assert [s.url for s in p.states] == ["http://i1", "http://i9"]
    assert p.states[0] is b and not b.healthy  # known: the same state, down until a probe says up
    assert left == [a] and a.outstanding == 1  # gone from the pool; its request in flight goes on
    assert built == ["http://i9"]  # a client only for the new one
    assert p.set_members(["http://i1", "http://i9"], make) == [] and built == ["http://i9"]
    left = p.set_members([], make)
    assert [s.url for s in left] == ["http://i1", "http://i9"] and p.candidates() == []


def test_a_probe_counts_the_streams_other_proxies_run_there():
    class Reporting(FakeUpstream):
        async def health(self):
            return True, Health(load=Load(num_running=5))
    p = Pool("decode", [Reporting("http://d0")])
    d = p.states[0]
    d.outstanding = 3  # this proxy's, all running
    asyncio.run(p.probe())
    assert d.others_running == 2 and d.streams() == 5
    d.outstanding = 0  # this proxy's ended since: the others' stay counted until the next probe
    assert d.streams() == 2
    d.outstanding = 7  # more of this proxy's than the instance runs (some wait for their KV)
    asyncio.run(p.probe())
    assert d.others_running == 0 and d.streams() == 7
