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


def test_a_decode_instance_prefilling_a_prompt_itself_claims_what_another_caches(pd):
    """What the proxy sends a local prefill under kv-aware routing (`kv_holders` of the instances
    caching more of the prompt): decode READs the history another decode instance caches, computes
    only the rest, and answers as transformers; nothing stays pinned on either."""
    d0, d1 = pd.decode
    first = ids(100, seed=930)
    code, body = post_json(d0.url + "/v1/completions", {"prompt": first, "max_tokens": 16, "temperature": 0,
                                                        "return_token_ids": True})
    assert code == 200, body
    answer = body["choices"][0]["token_ids"]
    second = first + answer + ids(30, seed=931)
    held = (len(first) + len(answer) - 1) // 16  # d0 computed all but its last answer token
    holder = get_json(d0.url + "/health")["load"]["kv_holder"]
    names = ("pdserve:kv_blocks_pulled_total", "pdserve:prompt_tokens_computed_total")
    before = [metric(d1, n) for n in names]
    code, body = post_json(d1.url + "/v1/completions", {
        "prompt": second, "max_tokens": 16, "temperature": 0, "return_token_ids": True,
        "kv_transfer_params": {"kv_holders": [holder]}})
    assert code == 200, body
    assert_greedy_match(body["choices"][0]["token_ids"], hf_reference(pd.model, second, 16), "decode pulled")
    assert [metric(d1, n) - b for n, b in zip(names, before)] == [held, len(second) - 16 * held]
    for inst in (d0, d1):
        s = wait_idle(inst)
        assert s["num_free_blocks"] == s["num_blocks"]


def test_decode_instances_split_a_prefill_beside_their_streams_and_say_so(pd):
    """`pdserve up` starts decode instances with --max-prefill-stall-s 0.1 (producers run no streams);
    each reports it in /health, where the proxy reads how long a local prefill holds the streams."""
    assert [get_json(i.url + "/health")["load"]["max_prefill_stall_s"] for i in pd.decode] == [0.1, 0.1]
    assert [get_json(i.url + "/health")["load"]["max_prefill_stall_s"] for i in pd.prefill] == [0.0]
