"""KV events on the wire: vLLM's schema in both encodings, and the publisher's PUB and replay sockets."""

from __future__ import annotations

import time

import msgspec
import pytest

from pdserve.config import ConfigError, KVEventsConfig
from pdserve.prefix_cache.events import (AllBlocksCleared, BlockRemoved, BlockStored, EventBatch,
                                         decode_batch, encode_batch)
from pdserve.prefix_cache.publisher import KVEventPublisher
from pdserve.prefix_cache.subscriber import BlockIndex, KVEventSubscriber

STORED = BlockStored(block_hashes=[2 ** 64 - 1, 5], parent_block_hash=None, token_ids=list(range(8)),
                     block_size=4, extra_keys=[["model", "salt"], ["model", "salt"]])
BATCH = EventBatch(ts=1.5, events=[STORED, BlockRemoved(block_hashes=[5]), AllBlocksCleared()],
                   data_parallel_rank=0)


def test_map_encoding_is_tagged_maps():
    raw = msgspec.msgpack.decode(encode_batch(BATCH, "map"))
    assert raw["ts"] == 1.5 and raw["data_parallel_rank"] == 0
    stored, removed, cleared = raw["events"]
    assert stored == {"type": "BlockStored", "block_hashes": [2 ** 64 - 1, 5], "parent_block_hash": None,
                      "token_ids": list(range(8)), "block_size": 4, "lora_id": None, "medium": "cpu",
                      "lora_name": None, "extra_keys": [["model", "salt"], ["model", "salt"]]}
    assert removed == {"type": "BlockRemoved", "block_hashes": [5], "medium": "cpu"}
    assert cleared == {"type": "AllBlocksCleared"}


def test_array_encoding_is_vllms_positional_form():
    raw = msgspec.msgpack.decode(encode_batch(BATCH, "array"))
    assert raw[0] == 1.5 and raw[2] == 0
    assert raw[1][0] == ["BlockStored", [2 ** 64 - 1, 5], None, list(range(8)), 4, None, "cpu", None,
                         [["model", "salt"], ["model", "salt"]]]
    assert raw[1][1:] == [["BlockRemoved", [5], "cpu"], ["AllBlocksCleared"]]


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_either_encoding_decodes_to_the_same_batch(encoding):
    assert decode_batch(encode_batch(BATCH, encoding)) == BATCH


def test_decoder_tolerates_older_and_newer_publishers():
    older = msgspec.msgpack.encode([2.0, [["BlockRemoved", [1]], ["SomethingNew", 1]]])  # no rank, no medium
    assert decode_batch(older) == EventBatch(ts=2.0, events=[BlockRemoved([1])])
    newer = msgspec.msgpack.encode({"ts": 3.0, "events": [{"type": "BlockRemoved", "block_hashes": [1],
                                                           "medium": "GPU", "group_idx": 0}]})
    assert decode_batch(newer).events == [BlockRemoved([1], medium="GPU")]


def test_config_is_vllms_json_and_names_the_bad_key():
    c = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "zmq", '
                                 '"endpoint": "tcp://*:5557", "topic": "kv", "buffer_steps": 5}')
    assert c.enabled and c.buffer_steps == 5
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "null"}').enabled
    for bad, field in [('{"enable_kv_cache_events": 1}', "enable_kv_cache_events"),
                       ('{"encoding": "cbor"}', "encoding"), ('{"endpoint": "5557"}', "endpoint"),
                       ('{"buffer": 1}', "unknown keys"), ("[1]", "JSON object"), ("{", "not JSON")]:
        with pytest.raises(ConfigError, match=field):
            KVEventsConfig.from_json(bad)


def _config(**kw) -> KVEventsConfig:
    return KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:0",
                          replay_endpoint="tcp://127.0.0.1:0", **kw)


@pytest.fixture
def publisher():
    pub = KVEventPublisher(_config(), topic="kv@test@e1")
    yield pub
    pub.close()


def _subscribe(pub: KVEventPublisher) -> KVEventSubscriber:
    """A subscriber that is connected (a PUB drops what it sends before the connection is up)."""
    sub = KVEventSubscriber(pub.endpoint, pub.replay_endpoint)
    deadline = time.monotonic() + 5
    while True:
        pub.emit([AllBlocksCleared()])
        if sub.recv(0.05) is not None:
            while sub.recv(0.05) is not None:
                pass
            return sub
        assert time.monotonic() < deadline, "subscriber never connected"


def test_events_flush_within_20_ms_with_no_engine_step(publisher):
    assert publisher.endpoint.startswith("tcp://127.0.0.1:") and not publisher.endpoint.endswith(":0")
    sub = _subscribe(publisher)
    delays = []
    try:
        for _ in range(5):
            t = time.monotonic()
            publisher.emit([STORED])  # nobody calls flush: the publisher's own thread sends it
            got = sub.recv(1.0)
            assert got is not None
            delays.append(time.monotonic() - t)
            topic, seq, batch = got
            assert topic == "kv@test@e1" and batch.events == [STORED] and batch.data_parallel_rank == 0
    finally:
        sub.close()
    assert sorted(delays)[2] < 0.02, delays  # the median: two shared cores may delay one wake-up


def test_replay_from_zero_returns_every_batch_and_flush_orders_a_snapshot(publisher):
    for i in range(7):
        publisher.emit([BlockRemoved([i])])
        assert publisher.flush() == i  # sealed at once: a snapshot taken now is consistent with i
    sub = KVEventSubscriber(publisher.endpoint, publisher.replay_endpoint)
    try:
        replayed = sub.replay(0)
        assert [seq for seq, _ in replayed] == list(range(7))
        assert [b.events for _, b in replayed] == [[BlockRemoved([i])] for i in range(7)]
        assert [seq for seq, _ in sub.replay(5)] == [5, 6]
        assert sub.replay(7) == []
    finally:
        sub.close()


def test_replay_keeps_only_buffer_steps_batches_and_an_index_sees_the_gap():
    pub = KVEventPublisher(_config(buffer_steps=3), topic="t")
    try:
        for i in range(5):
            pub.emit([BlockStored([i], None, [i], 1)])
            pub.flush()
        sub = KVEventSubscriber(pub.endpoint, pub.replay_endpoint)
        replayed = sub.replay(0)
        sub.close()
    finally:
        pub.close()
    assert [seq for seq, _ in replayed] == [2, 3, 4]
    index = BlockIndex()
    assert not index.apply(*replayed[0]) and index.gap  # batches 0 and 1 are gone: take a snapshot
