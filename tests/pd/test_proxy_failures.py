"""The proxy against real instances that fail or are asked odd things (issue "found from outside"):
a client's template error is a 400 at once (not "busy" after the proxy's wait), one token with no
producer registered, a long or reused X-Request-Id, chat content given as parts, and a decode leg
that an instance took and then never answered is not sent to a second decode instance. After each,
every instance is idle and still answers."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import httpx
import pytest

from helpers import assert_greedy_match, hf_reference, ids
from pdserve.launcher import Instance
from servers import get_json, metric, post_json, start_deployment, wait_idle

LOCAL_MAX = 64


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("proxy-failures")


@pytest.fixture(scope="module")
def pd(tiny_model, logs):
    dep = start_deployment(tiny_model, 1, 1, logs, extra=["--trust-request-chat-template"],
                           proxy_args=["--local-prefill-max-tokens", str(LOCAL_MAX)])
    dep.model = tiny_model
    yield dep
    dep.stop()


def _proxy(logs, dep, prefill: list[str], decode: list[str], *extra: str) -> Instance:
    args = ["proxy", "--port", "0", "--prefill", *prefill, "--decode", *decode, *extra]
    return Instance("proxy", args).spawn(logs, dep.env).wait_healthy(60)


def _all_idle(dep) -> None:
    for inst in dep.instances:
        s = wait_idle(inst)
        assert s["num_free_blocks"] == s["num_blocks"], f"{inst.role} holds blocks: {s}"


def _still_answers(dep, url: str) -> None:
    p = ids(12, seed=77)
    code, body = post_json(url + "/v1/completions", {"prompt": p, "max_tokens": 4, "temperature": 0,
                                                     "return_token_ids": True})
    assert code == 200, body
    assert_greedy_match(body["choices"][0]["token_ids"], hf_reference(dep.model, p, 4), "after a failure")


def test_a_template_error_is_a_400_at_once_not_busy(pd):
    start = time.monotonic()  # long enough to be prefilled on the producer
    code, body = post_json(pd.proxy.url + "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "a long question " * 40}],
                            "max_tokens": 4, "chat_template": "{{ 1/0 }}"})
    assert code == 400 and body["error"]["param"] == "chat_template", body
    assert time.monotonic() - start < 5
    _all_idle(pd)
    _still_answers(pd, pd.proxy.url)


def test_one_token_with_no_producer_registered(pd, logs):
    proxy = _proxy(logs, pd, [], [pd.decode[0].url])
    try:
        start = time.monotonic()
        code, body = post_json(proxy.url + "/v1/completions", {"prompt": "hello", "max_tokens": 1})
        assert code == 200 and body["choices"][0]["finish_reason"] == "length", body
        assert time.monotonic() - start < 5
    finally:
        proxy.stop()
    _all_idle(pd)


def test_a_long_or_reused_client_request_id_is_not_the_transfer_id(pd):
    trace = "t" * 250  # a gateway's trace id
    code, body = post_json(pd.proxy.url + "/v1/completions", {"prompt": ids(100, seed=3), "max_tokens": 6},
                           headers={"X-Request-Id": trace})
    assert code == 200, body
    before = metric(pd.decode[0], "pdserve:kv_transfers_total")
    prompts = [ids(LOCAL_MAX + 10 + i, seed=20 + i) for i in range(4)]
    with httpx.Client(timeout=60) as client:  # four requests at once under one id
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda p: client.post(
                pd.proxy.url + "/v1/completions", headers={"X-Request-Id": "same"},
                json={"prompt": p, "max_tokens": 6, "temperature": 0, "return_token_ids": True}), prompts))
    for p, r in zip(prompts, answers):
        assert r.status_code == 200, r.text
        assert r.headers["X-PD-Decision"] == "remote"
        assert_greedy_match(r.json()["choices"][0]["token_ids"], hf_reference(pd.model, p, 6), "same id")
    assert metric(pd.decode[0], "pdserve:kv_transfers_total") == before + 4
    _all_idle(pd)


def test_chat_content_parts_count_toward_the_prompt_length(pd):
    parts = [{"type": "text", "text": "the quick brown fox " * 40}, {"type": "text", "text": "jumps " * 80}]
    r = httpx.post(pd.proxy.url + "/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": parts}], "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.headers["X-PD-Decision"] == "remote"
    r = httpx.post(pd.proxy.url + "/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                         "max_tokens": 4})
    assert r.status_code == 200 and r.headers["X-PD-Decision"] == "local", r.text
    _all_idle(pd)


@pytest.fixture
def stalling(logs):
    """A fake decode instance that takes requests and never answers (tests/stall_server.py)."""
    proc = subprocess.Popen([sys.executable, str(Path(__file__).parent.parent / "stall_server.py")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(10)


def _healthy(proxy: Instance) -> dict[str, float]:
    with urllib.request.urlopen(proxy.url + "/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return {line.split('upstream="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in lines if line.startswith("pdserve_proxy:upstream_healthy{")}


@pytest.mark.parametrize("kind", ["stalls", "dies"])
def test_a_decode_leg_an_instance_took_is_not_sent_to_another(pd, logs, stalling, kind):
    proxy = _proxy(logs, pd, [pd.prefill[0].url], [stalling, pd.decode[0].url], "--request-timeout-s", "1")
    try:
        before = metric(pd.decode[0], "pdserve:kv_transfers_total")
        codes = []
        for i in range(2):  # equal instances take turns: one request each
            prompt = f"{'die ' if kind == 'dies' else ''}request {i} " * 5
            start = time.monotonic()
            code, body = post_json(proxy.url + "/v1/completions", {"prompt": prompt, "max_tokens": 4})
            codes.append(code)
            if code != 200:
                assert code == 502 and stalling in body["error"]["message"], body
                assert time.monotonic() - start < 10
        assert sorted(codes) == [200, 502]
        taken = get_json(stalling + "/taken")["taken"]
        assert taken == 1 and metric(pd.decode[0], "pdserve:kv_transfers_total") == before + 1
        if kind == "stalls":  # alive and busy: not marked down
            assert _healthy(proxy)[stalling] == 1.0
        _all_idle(pd)  # the lease the stalled leg never read went back to the producer
    finally:
        proxy.stop()
    _still_answers(pd, pd.proxy.url)
