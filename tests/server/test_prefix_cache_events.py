"""One real instance with KV events on: cache_salt isolates, prefix-cache metrics count, and a
subscriber that applies the instance's events holds exactly what the pool caches (after evictions,
a reset, and when it joins late and replays)."""

from __future__ import annotations

import json
import random
import time
import urllib.request

import msgspec
import pytest

from pdserve.prefix_cache.events import AllBlocksCleared, BlockRemoved, Snapshot
from pdserve.prefix_cache.hashing import prompt_event_hashes
from pdserve.prefix_cache.subscriber import BlockIndex, KVEventSubscriber

from servers import get_json, metric, post_json, start_server, stats

NUM_BLOCKS = 24  # 384 tokens: a few 64-token prompts fill it, so blocks are evicted
CONFIG = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:0",
          "replay_endpoint": "tcp://127.0.0.1:0", "role": "decode"}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    inst = start_server(tiny_model, tmp_path_factory.mktemp("kv-events"), "--no-kv-transfer",
                        "--kv-events-config", json.dumps(CONFIG), num_blocks=NUM_BLOCKS)
    yield inst
    inst.stop()


@pytest.fixture(scope="module")
def info(server) -> dict:
    return get_json(server.url + "/health")["prefix_cache"]


def _prompt(seed: int, n: int = 64) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(7, 1000) for _ in range(n)]


def _complete(server, prompt, **kw) -> dict:
    code, body = post_json(server.url + "/v1/completions",
                           {"prompt": prompt, "max_tokens": 2, "temperature": 0, **kw})
    assert code == 200, body
    return body


def _cached(server) -> set[int]:
    return set(get_json(server.url + "/debug/kv_cached_hashes")["block_hashes"])


def _snapshot(server) -> Snapshot:
    with urllib.request.urlopen(server.url + "/kv/events/snapshot", timeout=10) as r:
        return msgspec.json.decode(r.read(), type=Snapshot)


def test_health_says_where_the_events_are_and_how_blocks_are_hashed(server, info):
    engine_id = stats(server)["engine_id"]
    events = info["kv_events"]
    assert events["endpoint"].startswith("tcp://127.0.0.1:") and not events["endpoint"].endswith(":0")
    assert events["replay_endpoint"].startswith("tcp://127.0.0.1:")
    assert events["topic"] == f"kv@decode@{engine_id}" and events["encoding"] == "map"
    assert info["hash_algorithm"] == "sha256" and info["block_size"] == 16 and info["model_key"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("salt", ["", 5, ["a"], "x" * 1025])
def test_cache_salt_must_be_a_short_non_empty_string(server, path, salt):
    body = {"prompt": "hello"} if path == "/v1/completions" else {"messages": [{"role": "user",
                                                                                "content": "hello"}]}
    code, resp = post_json(server.url + path, {**body, "max_tokens": 1, "cache_salt": salt})
    assert code == 400 and resp["error"]["param"] == "cache_salt", resp


def test_a_salt_never_hits_another_salts_blocks_and_metrics_count_it(server, info):
    prompt = _prompt(1)
    before = stats(server)["num_prompt_tokens_computed"]
    queries, hits = (metric(server, f"pdserve:prefix_cache_{n}_total") for n in ("queries", "hits"))
    computed = []
    for salt in ("tenant-a", "tenant-b", None, "tenant-a"):
        _complete(server, prompt, **({"cache_salt": salt} if salt else {}))
        now = stats(server)["num_prompt_tokens_computed"]
        computed.append(now - before)
        before = now
    assert computed == [64, 64, 64, 16]  # only the same salt hits (three full blocks; one is left)
    assert metric(server, "pdserve:prefix_cache_queries_total") - queries == 4 * 64
    assert metric(server, "pdserve:prefix_cache_hits_total") - hits == 48
    # a router computes the instance's hashes from the token ids, the model key and the salt alone
    held = _cached(server)
    for salt in ("tenant-a", "tenant-b", None):
        assert set(prompt_event_hashes(prompt, 16, info["model_key"], salt)[:3]) <= held
    blocks = {b.block_hashes[0]: b for b in _snapshot(server).blocks}
    first = prompt_event_hashes(prompt, 16, info["model_key"], "tenant-a")[0]
    assert blocks[first].extra_keys == [[info["model_key"], "tenant-a"]]
    assert blocks[first].token_ids == prompt[:16] and blocks[first].parent_block_hash is None


def _follow(sub: KVEventSubscriber, index: BlockIndex, until_seq: int, seen: list,
            timeout_s: float = 10.0) -> None:
    """Apply published batches up to `until_seq`, replaying whatever the PUB socket did not bring."""
    deadline = time.monotonic() + timeout_s
    while index.next_seq <= until_seq:
        assert time.monotonic() < deadline, f"events stopped at {index.next_seq}, expected {until_seq}"
        got = sub.recv(0.2)
        if got is not None:
            _, seq, batch = got
            if index.apply(seq, batch):
                seen.extend(batch.events)
        if index.gap or got is None:
            for seq, batch in sub.replay(index.next_seq):
                if index.apply(seq, batch):
                    seen.extend(batch.events)


def test_a_subscriber_holds_exactly_what_the_instance_caches(server, info):
    events = info["kv_events"]
    sub = KVEventSubscriber(events["endpoint"], events["replay_endpoint"], topic="kv@decode@")
    try:
        index, seen = BlockIndex(), []
        index.load(_snapshot(server))
        shared = _prompt(2, 32)
        for i in range(12):  # 12 prompts of 4 to 5 blocks into 24 blocks, two thirds sharing a prefix
            prompt = (shared if i % 3 else []) + _prompt(100 + i, 48)
            _complete(server, prompt, **({"cache_salt": "s"} if i % 4 == 0 else {}))
        _follow(sub, index, _snapshot(server).seq, seen)
        assert any(isinstance(e, BlockRemoved) for e in seen)  # the run evicted blocks
        assert index.hashes == _cached(server) and index.hashes
        code, _ = post_json(server.url + "/reset_prefix_cache", {})
        assert code == 200 and _cached(server) == set()
        # the engine is idle now and nobody asks for a snapshot: the publisher's own timer sends it
        _follow(sub, index, index.next_seq, seen)
        assert seen[-1] == AllBlocksCleared() and index.hashes == set()
    finally:
        sub.close()


def test_a_late_subscriber_replays_every_batch_from_zero(server, info):
    _complete(server, _prompt(7))
    last = _snapshot(server).seq
    events = info["kv_events"]
    sub = KVEventSubscriber(events["endpoint"], events["replay_endpoint"])
    try:
        replayed = sub.replay(0)
    finally:
        sub.close()
    assert [seq for seq, _ in replayed] == list(range(last + 1))
    index = BlockIndex()
    for seq, batch in replayed:
        assert index.apply(seq, batch)
    assert index.hashes == _cached(server) and index.hashes
