"""KV-aware routing through real processes (1 producer, 2 decode instances, `pdserve up`'s
defaults: instances publish KV events, the proxy tokenizes and indexes them): the index equals what
each instance caches, a conversation's next turn goes to the decode instance holding its history,
and when that instance lacks little of the prompt it prefills it itself, skipping the producer."""

from __future__ import annotations

import time

import httpx
import pytest

from helpers import assert_greedy_match, hf_reference, ids
from pdserve.launcher import Deployment
from servers import INSTANCE_ARGS, get_json, metric, post_json, wait_idle


@pytest.fixture(scope="module")
def pd(tiny_model, tmp_path_factory):
    dep = Deployment(tiny_model, [1], [1, 1], instance_args=INSTANCE_ARGS,
                     log_dir=str(tmp_path_factory.mktemp("kv-routing")))
    dep.start(timeout_s=120)
    dep.model = tiny_model
    yield dep
    dep.stop()


def _indexed_equals_cached(pd, timeout_s: float = 3.0) -> None:
    """Within `timeout_s`, the proxy's index holds exactly the blocks each instance caches."""
    deadline = time.monotonic() + timeout_s
    while True:
        index = get_json(pd.proxy.url + "/kv/index?hashes=true")["instances"]
        cached = {i.url: get_json(i.url + "/debug/kv_cached_hashes")["block_hashes"] for i in pd.instances}
        if index == cached or time.monotonic() > deadline:
            assert index == cached
            return
        time.sleep(0.05)


def _complete(pd, prompt: list[int], max_tokens: int = 16):
    code, body = post_json(pd.proxy.url + "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens,
                                                              "temperature": 0, "return_token_ids": True})
    assert code == 200, body
    return body["choices"][0]["token_ids"]


def _computed(pd) -> list[float]:
    return [metric(d, "pdserve:prompt_tokens_computed_total") for d in pd.decode]


def test_the_index_is_exact(pd):
    for i in range(3):
        _complete(pd, ids(100 + 20 * i, seed=900 + i))
    _indexed_equals_cached(pd)


def test_a_next_turn_goes_where_its_history_is_and_skips_the_producer(pd):
    first = ids(200, seed=910)
    answer = _complete(pd, first)
    _indexed_equals_cached(pd)
    before = _computed(pd)
    second = first + answer + ids(30, seed=911)  # decode holds 208 of these 246 tokens
    code, body = post_json(pd.proxy.url + "/v1/completions",
                           {"prompt": second, "max_tokens": 16, "temperature": 0, "return_token_ids": True})
    assert code == 200, body
    assert_greedy_match(body["choices"][0]["token_ids"], hf_reference(pd.model, second, 16), "kv-aware turn 2")
    grew = [after - b for after, b in zip(_computed(pd), before)]
    assert sorted(grew) == [0, len(second) - 208]  # one decode instance prefilled only what it lacked
    for inst in pd.instances:
        s = wait_idle(inst)
        assert s["num_free_blocks"] == s["num_blocks"]


def test_the_decision_header_says_local_when_decode_holds_the_history(pd):
    first = ids(180, seed=920)
    answer = _complete(pd, first)
    _indexed_equals_cached(pd)
    second = first + answer + ids(20, seed=921)
    r = httpx.post(pd.proxy.url + "/v1/completions", timeout=60,
                   json={"prompt": second, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.headers["X-PD-Decision"] == "local"
    for n in (300, 20):  # nobody holds them: a producer prefills them, however short
        r = httpx.post(pd.proxy.url + "/v1/completions", timeout=60,
                       json={"prompt": ids(n, seed=922 + n), "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.headers["X-PD-Decision"] == "remote"
