"""The router's choice, as pure logic: healthy before down, least loaded first (this proxy's
outstanding requests plus the queue the instance reports), equals taking turns."""

from __future__ import annotations

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
