"""The proxy: xPyD round-robin, the first-token rules (docs/design.md, "Wire"), chat and streaming, its own
endpoints. A 2 prefill + 1 decode deployment (TP 1 each)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from helpers import assert_greedy_match, hf_reference, ids
from pdserve.launcher import Deployment
from servers import INSTANCE_ARGS, metric, post_json, stats, wait_idle


@pytest.fixture(scope="module")
def xpyd(tiny_model, tmp_path_factory):
    dep = Deployment(tiny_model, [1, 1], [1], instance_args=INSTANCE_ARGS,
                     log_dir=str(tmp_path_factory.mktemp("xpyd")))
    dep.start(timeout_s=120)
    dep.model = tiny_model
    yield dep
    dep.stop()


def test_round_robin_over_prefill_instances(xpyd):
    for i in range(4):
        p = ids(20, seed=i)
        code, body = post_json(xpyd.proxy.url + "/v1/completions",
                               {"prompt": p, "max_tokens": 8, "temperature": 0, "return_token_ids": True})
        assert code == 200
        assert_greedy_match(body["choices"][0]["token_ids"], hf_reference(xpyd.model, p, 8), "xpyd")
    for prefill in xpyd.prefill:  # each producer served two prompts and handed both to decode
        assert stats(prefill)["num_prompt_tokens"] >= 2 * 20
    assert metric(xpyd.decode[0], "pdserve:nixl_handshakes_total") == 2  # one per producer


def test_max_tokens_one_is_answered_by_the_producer(xpyd):
    p = ids(25, seed=10)
    before = metric(xpyd.decode[0], "pdserve:kv_transfers_total")
    code, body = post_json(xpyd.proxy.url + "/v1/completions",
                           {"prompt": p, "max_tokens": 1, "temperature": 0, "return_token_ids": True})
    assert code == 200 and body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["token_ids"] == hf_reference(xpyd.model, p, 1).tokens
    assert body.get("kv_transfer_params") is None
    assert metric(xpyd.decode[0], "pdserve:kv_transfers_total") == before  # no transfer
    for inst in xpyd.instances:  # the producer freed its blocks at once
        s = wait_idle(inst)
        assert s["num_free_blocks"] == s["num_blocks"]


def test_stop_on_the_first_token_is_answered_by_the_producer_streaming(xpyd):
    p = ids(30, seed=11)
    code, full = post_json(xpyd.proxy.url + "/v1/completions",
                           {"prompt": p, "max_tokens": 6, "temperature": 0})
    first_text = full["choices"][0]["text"][:1] or None
    if not first_text:
        pytest.skip("the first token decodes to no text")
    events = []
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", xpyd.proxy.url + "/v1/completions",
                      json={"prompt": p, "max_tokens": 6, "temperature": 0, "stop": [first_text],
                            "stream": True, "stream_options": {"include_usage": True}}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e[6:]) for e in events if e != "data: [DONE]"]
    assert events[-1] == "data: [DONE]"
    assert chunks[0]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["usage"]["completion_tokens"] == 1
    for inst in xpyd.instances:
        assert wait_idle(inst)["num_free_blocks"] == stats(inst)["num_blocks"]


def test_chat_and_models_through_the_proxy(xpyd):
    client = openai.OpenAI(base_url=xpyd.proxy.url + "/v1", api_key="x", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    messages = [{"role": "user", "content": "tell me about the cache"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    direct = openai.OpenAI(base_url=xpyd.decode[0].url + "/v1", api_key="x", max_retries=0)
    colocated = direct.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                               temperature=0)
    assert full.choices[0].message.content == colocated.choices[0].message.content
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                                 temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        full.choices[0].message.content


def test_the_proxy_tokenizes_chats_to_the_producers_count(xpyd):
    """Prefilled remotely, a chat's prompt is counted by the producer; the proxy's own ids (what it
    routes by) have that length, so no mismatch is counted."""
    messages = [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": " ".join(f"word{i} ünïcödé  tab\there" for i in range(60))}]
    with httpx.Client(timeout=60) as h:
        r = h.post(xpyd.proxy.url + "/v1/chat/completions",
                   json={"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.headers["X-PD-Decision"] == "remote"
        assert r.json()["usage"]["prompt_tokens"] > 200
    assert metric(xpyd.proxy, "pdserve_proxy:prompt_token_mismatches_total") == 0


def test_proxy_errors_and_metrics(xpyd):
    code, body = post_json(xpyd.proxy.url + "/v1/completions", {"prompt": "x", "max_tokens": -3})
    assert code == 400 and body["error"]["param"] == "max_tokens"  # the producer's answer, passed on
    with httpx.Client() as h:
        r = h.post(xpyd.proxy.url + "/v1/completions", content=b"{oops")
        assert r.status_code == 400 and r.json()["error"]["param"] == "body"
        assert h.get(xpyd.proxy.url + "/health").json()["decode"]
        text = h.get(xpyd.proxy.url + "/metrics").text
    for name in ("pdserve_proxy:time_to_first_token_seconds", "pdserve_proxy:inter_token_latency_seconds",
                 "pdserve_proxy:time_per_output_token_seconds", "pdserve_proxy:e2e_request_latency_seconds"):
        assert f"{name}_count" in text



def test_serving_processes_keep_their_startup_heap_out_of_the_collector(xpyd):
    """Start-up leaves ~10^5 long-lived objects (torch, the web stack, the model): a full collection
    that scanned them all stopped decode's step for 156 ms and the proxy for 138 ms under load, which
    put a 176 ms gap into every stream at once. Each process freezes them once it serves, and times
    every collection it still makes."""
    complete_some = [post_json(xpyd.proxy.url + "/v1/completions", {"prompt": "freeze", "max_tokens": 4})
                     for _ in range(2)]
    assert all(code == 200 for code, _ in complete_some)
    for inst in [*xpyd.prefill, *xpyd.decode]:
        assert metric(inst, "pdserve:gc_frozen_objects") > 10_000, inst.role
        assert metric(inst, "pdserve:gc_pause_seconds_count") > 0, inst.role
    assert metric(xpyd.proxy, "pdserve_proxy:gc_frozen_objects") > 10_000
    assert metric(xpyd.proxy, "pdserve_proxy:gc_pause_seconds_count") > 0

def _transfer_counters(decode) -> tuple[float, float, float]:
    return (metric(decode, "pdserve:kv_transfers_total"), metric(decode, "pdserve:nixl_bytes_transferred_sum"),
            metric(decode, "pdserve:prompt_tokens_computed_total"))


def _kv_bytes(model: str, num_tokens: int) -> int:
    """Bytes of KV the whole prompt's blocks hold (every layer, K and V, every head)."""
    from pdserve.model.spec import ModelSpec
    spec = ModelSpec.from_dir(model)
    blocks = -(-num_tokens // 16)
    return blocks * 16 * spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 4


def _assert_one_read_and_no_local_prefill(decode, before, model, num_tokens):
    transfers, num_bytes, computed = _transfer_counters(decode)
    assert transfers == before[0] + 1, "decode did not READ the prompt's KV"
    assert num_bytes - before[1] == _kv_bytes(model, num_tokens), "the READ was not the whole prompt"
    assert computed == before[2], "decode computed prompt tokens itself"


def test_vllm_toy_proxy_protocol_reads_the_kv(xpyd):
    """vLLM's toy proxy: prefill with max_tokens 1, stream false and null remote_* keys; the params
    that come back go to decode with the client's original body. The producer hands off anyway
    (vLLM's rule), decode READs the whole prompt once and computes none of it."""
    p = ids(40, seed=12)
    body = {"prompt": p, "max_tokens": 10, "temperature": 0, "return_token_ids": True}
    prefill_body = {**body, "stream": False, "max_tokens": 1, "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}}
    decode = xpyd.decode[0]
    before = _transfer_counters(decode)
    code, answer = post_json(xpyd.prefill[0].url + "/v1/completions", prefill_body)
    assert code == 200 and answer["kv_transfer_params"], answer
    code, final = post_json(decode.url + "/v1/completions",
                            {**body, "kv_transfer_params": answer["kv_transfer_params"]})
    assert code == 200
    assert_greedy_match(final["choices"][0]["token_ids"], hf_reference(xpyd.model, p, 10), "toy proxy")
    _assert_one_read_and_no_local_prefill(decode, before, xpyd.model, len(p))
    for inst in xpyd.instances:
        assert wait_idle(inst)["num_free_blocks"] == stats(inst)["num_blocks"]


@pytest.fixture(scope="module")
def vllm_mode_proxy(xpyd):
    from pdserve.launcher import Instance
    proxy = Instance("proxy-vllm", ["proxy", "--port", "0", "--upstream-protocol", "vllm",
                                    "--prefill", *[i.url for i in xpyd.prefill],
                                    "--decode", *[i.url for i in xpyd.decode]])
    proxy.spawn(xpyd.log_dir).wait_healthy(60)
    yield proxy
    proxy.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_the_proxy_in_vllm_mode_fronting_pdserve_instances(xpyd, vllm_mode_proxy, stream):
    p = ids(50, seed=13 + stream)
    decode = xpyd.decode[0]
    before = _transfer_counters(decode)
    request = {"prompt": p, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    if stream:
        tokens = []
        with httpx.Client(timeout=60) as h:
            with h.stream("POST", vllm_mode_proxy.url + "/v1/completions",
                          json={**request, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        tokens += json.loads(line[6:])["choices"][0].get("token_ids") or []
    else:
        code, body = post_json(vllm_mode_proxy.url + "/v1/completions", request)
        assert code == 200
        tokens = body["choices"][0]["token_ids"]
    assert_greedy_match(tokens, hf_reference(xpyd.model, p, 12), "proxy in vllm mode")
    _assert_one_read_and_no_local_prefill(decode, before, xpyd.model, len(p))


ADMIN_KEY = "admin-" + "k" * 16


@pytest.fixture(scope="module")
def managed_proxy(xpyd):
    """A proxy started with no instances: a cluster registers them (`pdserve up --ray` does)."""
    from pdserve.launcher import Instance
    proxy = Instance("proxy-managed", ["proxy", "--port", "0"])
    proxy.spawn(xpyd.log_dir, {"PDSERVE_ADMIN_KEY": ADMIN_KEY}).wait_healthy(60, listening_only=True)
    yield proxy
    proxy.stop()


def _register(proxy, body: dict, key: str = ADMIN_KEY) -> httpx.Response:
    return httpx.put(proxy.url + "/admin/upstreams", json=body, timeout=10,
                     headers={"Authorization": f"Bearer {key}"})


def test_instances_registered_and_dropped_at_run_time(xpyd, managed_proxy):
    url = managed_proxy.url
    request = {"prompt": ids(12, seed=20), "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    r = httpx.post(url + "/v1/completions", json=request, timeout=30)
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert "no decode instance registered" in r.json()["error"]["message"]
    assert _register(xpyd.proxy, {"prefill": [], "decode": []}).status_code == 404  # no admin key: no admin
    assert _register(managed_proxy, {"prefill": [], "decode": []}, key="wrong").status_code == 401
    bad = _register(managed_proxy, {"prefill": "http://a", "decode": []})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prefill"
    members = {"prefill": [i.url for i in xpyd.prefill], "decode": [xpyd.decode[0].url]}
    assert _register(managed_proxy, members).json() == members

    # a stream in flight when its decode instance leaves the proxy still ends whole
    p = ids(30, seed=21)
    tokens = []
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", url + "/v1/completions", json={
                "prompt": p, "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True,
                "return_token_ids": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    if not tokens:
                        assert _register(managed_proxy, {**members, "decode": []}).json()["decode"] == []
                    tokens += json.loads(line[6:])["choices"][0].get("token_ids") or []
    assert_greedy_match(tokens, hf_reference(xpyd.model, p, 200), "decode dropped mid-stream")
    assert len(tokens) == 200
    assert httpx.post(url + "/v1/completions", json=request, timeout=30).status_code == 503
    assert _register(managed_proxy, members).status_code == 200  # back
    r = httpx.post(url + "/v1/completions", json=request, timeout=30)
    assert r.status_code == 200, r.text
    assert_greedy_match(r.json()["choices"][0]["token_ids"], hf_reference(xpyd.model, request["prompt"], 4))
    for inst in xpyd.instances:
        assert wait_idle(inst)["num_free_blocks"] == stats(inst)["num_blocks"]
