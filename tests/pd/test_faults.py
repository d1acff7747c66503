"""Failures end in a clear per-request outcome, never a hang or a leaked block (docs/design.md, "Failures")."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from helpers import assert_greedy_match, hf_reference, ids as prompt
from servers import metric, post_json, start_server, stats, wait_idle

SHORT_LEASE = ["--kv-lease-s", "2", "--kv-transfer-timeout-s", "1"]  # quarantine: 2 s
FAST_FAIL = ["--kv-handshake-timeout-s", "2"]


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def producer(tiny_model, logs):
    inst = start_server(tiny_model, logs, *SHORT_LEASE, role="prefill")
    yield inst
    inst.stop()


@pytest.fixture(scope="module")
def decode(tiny_model, logs):
    inst = start_server(tiny_model, logs, *FAST_FAIL, role="decode")
    yield inst
    inst.stop()


def prefill(inst, ids: list[int], max_tokens: int = 16) -> dict:
    code, body = post_json(inst.url + "/v1/completions",
                           {"prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                            "kv_transfer_params": {"do_remote_decode": True}})
    assert code == 200 and body["kv_transfer_params"], body
    return body["kv_transfer_params"]


def decode_request(inst, ids, kv, **kw):
    return post_json(inst.url + "/v1/completions",
                     {"prompt": ids, "max_tokens": 16, "temperature": 0, "return_token_ids": True,
                      "kv_transfer_params": kv, **kw}, timeout=60)


def mutate(kv: dict, **changes) -> dict:
    out = dict(kv)
    for k, v in changes.items():
        if v is ...:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def test_bad_kv_transfer_params_are_400_and_leak_nothing(producer, decode):
    ids = prompt(40, seed=1)  # 3 blocks
    kv = prefill(producer, ids)
    other = prompt(40, seed=2)
    cases = [
        (mutate(kv, remote_block_ids="x"), "kv_transfer_params.remote_block_ids"),
        (mutate(kv, remote_block_ids=[-1, 2, 3]), "kv_transfer_params.remote_block_ids"),
        (mutate(kv, remote_block_ids=kv["remote_block_ids"][:2]), "kv_transfer_params.remote_block_ids"),
        (mutate(kv, tp_size=3), "kv_transfer_params.tp_size"),
        (mutate(kv, tp_size="1"), "kv_transfer_params.tp_size"),
        (mutate(kv, remote_port=70000), "kv_transfer_params.remote_port"),
        (mutate(kv, first_token_id=...), "kv_transfer_params.first_token_id"),
        (mutate(kv, first_token_id=10 ** 6), "kv_transfer_params.first_token_id"),
        (mutate(kv, remote_engine_id=None), "kv_transfer_params.remote_engine_id"),
        (mutate(kv, lease_s=-1), "kv_transfer_params.lease_s"),
        (mutate(kv, remote_host="a b"), "kv_transfer_params.remote_host"),
    ]
    for bad, field in cases:
        code, body = decode_request(decode, ids, bad)
        assert code == 400 and body["error"]["param"] == field, (field, body)
    code, body = decode_request(decode, other, kv)  # same block count, another prompt
    assert code == 400 and body["error"]["param"] == "kv_transfer_params.prompt_hash", body
    code, body = decode_request(decode, ids, kv, logprobs=2)  # the producer was not asked for them
    assert code == 400 and body["error"]["param"] == "kv_transfer_params.first_token_logprob", body
    s = wait_idle(decode)
    assert s["num_free_blocks"] == s["num_blocks"]
    code, body = decode_request(decode, ids, kv)  # the untouched params still work
    assert code == 200
    assert_greedy_match(body["choices"][0]["token_ids"], hf_reference(decode_model(decode), ids, 16), "ok")
    code, body = decode_request(decode, ids, kv)  # ... once: a replay could read reused blocks
    assert code == 400 and body["error"]["param"] == "kv_transfer_params.remote_request_id", body


def decode_model(inst) -> str:
    return inst.args[1]


def test_lease_expiry_frees_blocks_and_late_reader_is_refused(producer, decode):
    ids = prompt(30, seed=3)
    expired_before = metric(producer, "pdserve:kv_leases_expired_total")
    kv = prefill(producer, ids)
    assert stats(producer)["num_free_blocks"] < stats(producer)["num_blocks"]
    time.sleep(2.5)  # no consumer ever heartbeats: the 2 s lease ends
    deadline = time.monotonic() + 10
    while metric(producer, "pdserve:kv_leases_expired_total") == expired_before:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    s = wait_idle(producer, timeout_s=10)  # quarantine (2 s) then free
    assert s["num_free_blocks"] == s["num_blocks"] and s["num_quarantined_blocks"] == 0
    code, body = decode_request(decode, ids, kv)
    assert code == 500 and "no longer holds the KV" in body["error"]["message"], body
    assert wait_idle(decode)["num_free_blocks"] == stats(decode)["num_blocks"]


def test_unreachable_producer_fails_within_the_timeout(producer, decode):
    ids = prompt(20, seed=4)
    kv = prefill(producer, ids)
    ghost = mutate(kv, remote_engine_id="ghost-engine", remote_port=_closed_port())
    start = time.monotonic()
    code, body = decode_request(decode, ids, ghost)
    assert code == 500 and "unreachable" in body["error"]["message"], body
    assert time.monotonic() - start < 2 + 3
    assert wait_idle(decode)["num_free_blocks"] == stats(decode)["num_blocks"]


def _closed_port() -> int:
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_producer_killed_while_a_request_waits_on_it(tiny_model, logs, decode):
    victim = start_server(tiny_model, logs, role="victim")
    try:
        warm = prompt(20, seed=5)
        code, _ = decode_request(decode, warm, prefill(victim, warm))  # handshake cached
        assert code == 200
        ids = prompt(50, seed=6)
        kv = prefill(victim, ids)
        victim.kill()
        start = time.monotonic()
        events = []
        with httpx.Client(timeout=30) as h:
            with h.stream("POST", decode.url + "/v1/completions",
                          json={"prompt": ids, "max_tokens": 16, "temperature": 0, "stream": True,
                                "kv_transfer_params": kv}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
        assert time.monotonic() - start < 10
        assert events[0]["choices"][0]["text"] is not None  # the producer's first token came first
        assert "error" in events[-1], events[-1]
    finally:
        victim.stop()
    code, body = post_json(decode.url + "/v1/completions", {"prompt": "still here", "max_tokens": 4})
    assert code == 200
    assert wait_idle(decode)["num_free_blocks"] == stats(decode)["num_blocks"]


def test_recompute_policy_answers_anyway(tiny_model, logs):
    consumer = start_server(tiny_model, logs, *FAST_FAIL, "--kv-load-failure-policy", "recompute",
                            role="decode-recompute")
    victim = start_server(tiny_model, logs, role="victim2")
    try:
        ids = prompt(45, seed=7)
        kv = prefill(victim, ids)
        victim.kill()
        code, body = decode_request(consumer, ids, kv)
        assert code == 200, body
        assert_greedy_match(body["choices"][0]["token_ids"], hf_reference(tiny_model, ids, 16),
                            "recompute")
        assert wait_idle(consumer)["num_free_blocks"] == stats(consumer)["num_blocks"]
    finally:
        victim.stop()
        consumer.stop()


def test_incompatible_producer_is_named(tiny_kv1_model, logs, decode):
    other = start_server(tiny_kv1_model, logs, role="prefill-kv1")
    try:
        ids = prompt(20, seed=8)
        code, body = decode_request(decode, ids, prefill(other, ids))
        message = body["error"]["message"]
        assert code == 500 and "incompatible producer" in message and "num_kv_heads" in message, body
        assert wait_idle(other)["num_free_blocks"] == stats(other)["num_blocks"]  # released
    finally:
        other.stop()


def test_consumer_that_gives_up_before_reading_releases_the_producer(tiny_model, logs, producer):
    """A decode instance with one sequence slot, busy: the P/D request waits in its queue; the client
    leaves; the producer is told to release at once (not after its lease)."""
    busy = start_server(tiny_model, logs, "--max-num-seqs", "1", role="decode-busy")
    try:
        with httpx.Client(timeout=60) as h:
            with h.stream("POST", busy.url + "/v1/completions",
                          json={"prompt": "occupy", "max_tokens": 1000, "ignore_eos": True,
                                "stream": True}) as hog:
                hog_lines = hog.iter_lines()
                next(hog_lines)
                ids = prompt(40, seed=9)
                kv = prefill(producer, ids)
                released = metric(producer, "pdserve:kv_leases_released_total")
                with h.stream("POST", busy.url + "/v1/completions",
                              json={"prompt": ids, "max_tokens": 16, "stream": True,
                                    "kv_transfer_params": kv}) as r:
                    lines = r.iter_lines()
                    first = next(l for l in lines if l.startswith("data: {"))
                    assert json.loads(first[6:])["choices"][0]["text"] is not None
                deadline = time.monotonic() + 5
                while metric(producer, "pdserve:kv_leases_released_total") == released:
                    assert time.monotonic() < deadline, "the producer was never told to release"
                    time.sleep(0.05)
        s = wait_idle(producer, timeout_s=5)
        assert s["num_free_blocks"] == s["num_blocks"]
        assert wait_idle(busy)["num_free_blocks"] == stats(busy)["num_blocks"]
    finally:
        busy.stop()
