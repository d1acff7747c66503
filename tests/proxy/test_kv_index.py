"""The proxy's KV index on a real publisher (loopback ZMQ): exact despite batches its followers lose
on purpose (the benchmarks' hook, seeded, off by default), with the losses and repairs it reports."""

from __future__ import annotations

import time

import pytest

from pdserve.config import ConfigError, KVEventsConfig, ProxyConfig
from pdserve.health import EventEndpoints, Health, PrefixCacheInfo
from pdserve.prefix_cache.events import BlockRemoved, BlockStored
from pdserve.prefix_cache.publisher import KVEventPublisher
from pdserve.proxy.kv_index import KVIndex

URL = "http://127.0.0.1:9"  # its snapshot route is never needed: replay fills every gap here


def _health(pub: KVEventPublisher, engine_id: str) -> Health:
    events = EventEndpoints(endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint, topic=pub.topic,
                            last_seq=pub.info().last_seq)
    return Health(engine_id=engine_id, prefix_cache=PrefixCacheInfo(kv_events=events))


def _stored(h: int) -> BlockStored:
    return BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[1] * 4, block_size=4)


def _wait(done, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def publisher():
    pub = KVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:0",
                                          replay_endpoint="tcp://127.0.0.1:0"), topic="kv@test@e1")
    yield pub
    pub.close()


def test_an_index_losing_a_third_of_the_batches_is_exact_and_says_what_it_lost(publisher):
    index = KVIndex(drop_fraction=0.3, seed=1)
    try:
        index.update(URL, _health(publisher, "e1"))
        time.sleep(0.2)  # the SUB socket connected (a PUB drops what it sends before)
        held = set()
        for h in range(1, 61):
            publisher.emit([_stored(h)])
            held.add(h)
            if h % 3 == 0:
                publisher.emit([BlockRemoved(block_hashes=[h - 1])])
                held.discard(h - 1)
            publisher.flush()
            time.sleep(0.003)
        assert _wait(lambda: index.indexed(URL) == held)
        repairs = index.repairs(URL)
        assert repairs["batches_dropped"] > 5 and repairs["batches_replayed"] >= repairs["batches_dropped"]
        assert repairs["batches_received"] >= 40 and repairs["snapshots"] == 0
    finally:
        index.close()


def test_losing_nothing_is_the_default_and_a_restarted_instance_counts_from_zero(publisher):
    index = KVIndex()
    try:
        index.update(URL, _health(publisher, "e1"))
        time.sleep(0.2)
        publisher.emit([_stored(7)])
        assert _wait(lambda: index.indexed(URL) == {7})
        assert index.repairs(URL)["batches_dropped"] == 0
        index.update(URL, _health(publisher, "e2"))  # a new engine id: a new follower, its entries anew
        assert index.repairs(URL)["batches_received"] == 0
        assert index.repairs("http://127.0.0.1:10") is None
    finally:
        index.close()


def test_the_drop_fraction_is_checked():
    with pytest.raises(ConfigError, match="kv_events_drop_fraction"):
        ProxyConfig(prefill_urls=(), decode_urls=("http://127.0.0.1:1",), kv_events_drop_fraction=1.0)


def test_a_last_batch_lost_while_the_stream_is_quiet_is_repaired_at_the_next_probe(publisher):
    """Seed 0 loses the first batch; nothing follows it, so only the instance's /health (its
    last_seq, passed on at each probe) shows it was published."""
    index = KVIndex(drop_fraction=0.99, seed=0)
    try:
        index.update(URL, _health(publisher, "e1"))
        time.sleep(0.2)
        publisher.emit([_stored(9)])
        publisher.flush()
        assert _wait(lambda: index.repairs(URL)["batches_dropped"] == 1)
        time.sleep(0.3)  # quiet for 3 follower polls
        assert index.indexed(URL) == set()
        index.update(URL, _health(publisher, "e1"))  # the next probe
        assert _wait(lambda: index.indexed(URL) == {9}, 2.0)
    finally:
        index.close()
