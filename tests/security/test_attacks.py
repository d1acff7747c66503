"""Each attack a review reproduced, tried against a signed deployment as `pdserve up` starts it
(prefill + decode + proxy, a generated secret): none kills an instance, none reads KV it was not
handed, and after each the instances still answer correctly with every block back."""

from __future__ import annotations

import json
import os
import time

import httpx
import msgspec
import pytest
import zmq

from helpers import assert_greedy_match, hf_reference, ids
from pdserve.launcher import Deployment
from servers import INSTANCE_ARGS, get_json, metric, post_json, stats, wait_idle

SECRET = "test-secret-" + os.urandom(8).hex()


@pytest.fixture(scope="module")
def dep(tiny_model, tmp_path_factory):
    d = Deployment(tiny_model, [1], [1], instance_args=[*INSTANCE_ARGS, "--kv-lease-s", "5"],
                   env={"PDSERVE_KV_SECRET": SECRET}, log_dir=str(tmp_path_factory.mktemp("attacks")))
    d.start(timeout_s=120)
    d.model = tiny_model
    yield d
    d.stop()


def still_serving(dep, seed: int = 0) -> None:
    """The deployment answers a P/D request correctly, and every block is back."""
    p = ids(30, 1000 + seed)
    code, body = post_json(dep.proxy.url + "/v1/completions",
                           {"prompt": p, "max_tokens": 8, "temperature": 0, "return_token_ids": True})
    assert code == 200, body
    assert_greedy_match(body["choices"][0]["token_ids"], hf_reference(dep.model, p, 8), "after attack")
    for inst in dep.instances:
        s = wait_idle(inst, timeout_s=20)
        assert s["num_free_blocks"] == s["num_blocks"] and get_json(inst.url + "/debug/stats")


def produce(dep, prompt: list[int]) -> dict:
    code, body = post_json(dep.prefill[0].url + "/v1/completions",
                           {"prompt": prompt, "max_tokens": 4, "temperature": 0,
                            "kv_transfer_params": {"do_remote_decode": True}})
    assert code == 200 and body["kv_transfer_params"], body
    return body["kv_transfer_params"]


def release(dep, params: dict, consumer: str = "attack-test") -> None:
    """Hand the producer's lease back (as a consumer that gives up would)."""
    from pdserve.kv_transfer.messages import Release
    reply = side_channel(dep, Release(consumer, [params["remote_request_id"]], "test"))
    assert reply is not None


# --- numbers the engine cannot carry --------------------------------------------------------------

@pytest.mark.parametrize("field, value", [("seed", 2 ** 63), ("seed", 2 ** 64), ("seed", -2 ** 63 - 1),
                                          ("top_k", 2 ** 63), ("top_k", 2 ** 64), ("n", 3000),
                                          ("max_tokens", 2 ** 64), ("stop_token_ids", [2 ** 64]),
                                          ("temperature", float("inf"))])
def test_numbers_out_of_range_are_400_and_kill_nothing(dep, field, value):
    body = json.dumps({"prompt": "hello", "max_tokens": 4, field: value}).encode()
    for url in (dep.proxy.url, dep.prefill[0].url):
        r = httpx.post(url + "/v1/completions", content=body, headers={"Content-Type": "application/json"},
                       timeout=30)
        assert r.status_code == 400, (url, r.text)
        assert r.json()["error"]["param"] == field, r.text
    still_serving(dep, 1)


# --- forged transfer params ----------------------------------------------------------------------

def test_forged_block_ids_read_nothing(dep):
    """B's valid params with A's block ids: decode must refuse, not continue A's context."""
    a, b = ids(40, 1), ids(40, 2)
    pa, pb = produce(dep, a), produce(dep, b)
    forged = {**pb, "remote_block_ids": pa["remote_block_ids"]}
    code, body = post_json(dep.decode[0].url + "/v1/completions",
                           {"prompt": b, "max_tokens": 8, "temperature": 0, "kv_transfer_params": forged})
    assert code == 400 and body["error"]["param"] == "kv_transfer_params.signature", body
    release(dep, pa)
    release(dep, pb)
    still_serving(dep, 2)


@pytest.mark.parametrize("change", ["drop_prompt_hash", "drop_signature", "expired", "other_host"])
def test_params_not_signed_by_the_producer_are_refused_before_dialing(dep, change):
    p = ids(30, 3)
    params = produce(dep, p)
    forged = dict(params)
    if change == "drop_prompt_hash":
        forged.pop("prompt_hash")
    elif change == "drop_signature":
        forged.pop("signature", None)
    elif change == "expired":
        forged["expires_at"] = time.time() - 1
    else:
        forged["remote_host"] = "10.1.2.3"
    handshakes = metric(dep.decode[0], "pdserve:nixl_handshake_round_trips_total")
    code, body = post_json(dep.decode[0].url + "/v1/completions",
                           {"prompt": p, "max_tokens": 8, "kv_transfer_params": forged})
    assert code == 400 and body["error"]["param"].startswith("kv_transfer_params."), body
    assert metric(dep.decode[0], "pdserve:nixl_handshake_round_trips_total") == handshakes
    release(dep, params)
    still_serving(dep, 3)


def test_the_proxy_never_forwards_client_params(dep):
    """A client's own kv_transfer_params (here: a replay of real ones) never reach an instance."""
    p = ids(30, 4)
    params = produce(dep, p)
    transfers = metric(dep.decode[0], "pdserve:kv_transfers_total")
    for max_tokens in (1, 6):
        code, body = post_json(dep.proxy.url + "/v1/completions",
                               {"prompt": p, "max_tokens": max_tokens, "temperature": 0,
                                "return_token_ids": True, "kv_transfer_params": params})
        assert code == 200, body
        assert_greedy_match(body["choices"][0]["token_ids"], hf_reference(dep.model, p, max_tokens), "proxy")
    assert metric(dep.decode[0], "pdserve:kv_transfers_total") == transfers + 1  # only the proxy's own
    release(dep, params)
    still_serving(dep, 4)


# --- the side channel ---------------------------------------------------------------------------

def side_channel_port(dep) -> int:
    return get_json(dep.prefill[0].url + "/debug/stats")["kv_transfer"]["side_channel_port"]


def raw_exchange(dep, frames: list[bytes], timeout_s: float = 3.0):
    """Send frames on a fresh DEALER; the decoded reply, or None when nothing comes back."""
    from pdserve.kv_transfer.messages import SideChannelReply
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{side_channel_port(dep)}")
    try:
        sock.send_multipart(frames)
        if not sock.poll(int(timeout_s * 1000)):
            return None
        return msgspec.msgpack.decode(sock.recv_multipart()[-1], type=SideChannelReply)
    finally:
        sock.close(0)


def side_channel(dep, msg, secret: str | None = SECRET, client_id: bytes | None = None, seq: int = 1):
    from pdserve.kv_transfer.side_channel import encode_request
    frames = encode_request(secret.encode() if secret else None, client_id or os.urandom(16), seq, msg)
    return raw_exchange(dep, frames)


def test_a_64_mib_frame_is_dropped(dep):
    reply = raw_exchange(dep, [b"", b"\0" * 24, b"\x90" * (64 << 20)], timeout_s=2.0)
    assert reply is None  # ZMQ drops the connection before the frame is read
    still_serving(dep, 5)


def test_a_heartbeat_naming_a_million_ids_is_refused_at_once(dep):
    """A million ids (8 MB) is over the frame limit: the connection is dropped unread. Under the
    frame limit, over the list bound: a typed refusal, with no lease looked at."""
    from pdserve.kv_transfer.messages import ErrorReply, Heartbeat
    start = time.monotonic()
    assert side_channel(dep, Heartbeat("attacker", 1, [f"r{i}" for i in range(1_000_000)])) is None
    reply = side_channel(dep, Heartbeat("attacker", 1, [f"r{i}" for i in range(5000)]))
    assert isinstance(reply, ErrorReply) and "request_ids" in reply.error, reply
    assert time.monotonic() - start < 8.0  # two exchanges, the first waiting out its 3 s timeout
    still_serving(dep, 6)


def test_a_replayed_signed_heartbeat_is_refused(dep):
    from pdserve.kv_transfer.messages import ErrorReply, Heartbeat, HeartbeatAck
    cid = os.urandom(16)
    msg = Heartbeat("replayer", 1, ["nothing"])
    assert isinstance(side_channel(dep, msg, client_id=cid, seq=7), HeartbeatAck)
    reply = side_channel(dep, msg, client_id=cid, seq=7)  # the captured frames, sent again
    assert isinstance(reply, ErrorReply) and "replay" in reply.error, reply
    still_serving(dep, 7)


@pytest.mark.parametrize("secret", [None, "wrong-secret"])
def test_an_unauthenticated_handshake_is_refused(dep, secret):
    from pdserve.kv_transfer.messages import HANDSHAKE_VERSION, ErrorReply, HandshakeRequest
    engine_id = get_json(dep.prefill[0].url + "/debug/stats")["engine_id"]
    reply = side_channel(dep, HandshakeRequest(HANDSHAKE_VERSION, engine_id, [0]), secret=secret)
    assert isinstance(reply, ErrorReply) and "unauthenticated" in reply.error, reply


def test_malformed_messages_get_a_typed_error(dep):
    from pdserve.kv_transfer.messages import ErrorReply
    from pdserve.kv_transfer.side_channel import encode_request
    from pdserve.kv_transfer.frames import mac
    _, head, _ = encode_request(SECRET.encode(), os.urandom(16), 1, None)
    garbage = b"\xc1garbage"
    reply = raw_exchange(dep, [mac(SECRET.encode(), head, garbage), head, garbage])
    assert isinstance(reply, ErrorReply) and "malformed" in reply.error, reply
    still_serving(dep, 8)


def test_a_forged_done_notification_frees_nothing(dep):
    """Someone who reaches the producer's NIXL agent but has no secret claims a consumer's READ is
    done: the lease stays until its real consumer releases it."""
    from pdserve.kv_transfer.messages import (HANDSHAKE_VERSION, HandshakePayload, HandshakeRequest,
                                              Heartbeat, Notification, NotificationKind)
    from pdserve.transport.nixl_agent import NixlAgent
    producer = dep.prefill[0]
    params = produce(dep, ids(40, 9))
    rid = params["remote_request_id"]
    from pdserve.kv_transfer.params import KVTransferParams
    digest = KVTransferParams.parse(params).lease_digest()
    assert side_channel(dep, Heartbeat("legit-consumer", 1, [rid], [digest])).alive == [True]  # bound
    reply = side_channel(dep, HandshakeRequest(HANDSHAKE_VERSION, params["remote_engine_id"], [0]))
    metadata = msgspec.msgpack.decode(reply.payload, type=HandshakePayload).ranks[0].agent_metadata
    ignored = metric(producer, "pdserve:kv_notifications_ignored_total")
    for name in ("intruder/rank0", "legit-consumer/rank0"):  # a stranger, then a stolen name
        agent = NixlAgent(f"{name}")
        try:
            peer = agent.add_peer(metadata)
            agent.notify(peer, msgspec.msgpack.encode(
                Notification(rid, "legit-consumer", 0, 1, NotificationKind.DONE)))
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:  # NIXL sends only while its owner calls in
                agent.notifications()
                time.sleep(0.005)
        finally:
            agent.close()
    assert stats(producer)["num_free_blocks"] < stats(producer)["num_blocks"]  # still leased
    assert metric(producer, "pdserve:kv_notifications_ignored_total") >= ignored + 2
    release(dep, params, consumer="legit-consumer")
    still_serving(dep, 9)


# --- HTTP edges ---------------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["proxy", "server"])
def test_a_40_mib_body_is_413(dep, target):
    url = (dep.proxy if target == "proxy" else dep.decode[0]).url
    r = httpx.post(url + "/v1/completions", content=b'{"prompt": "' + b"a" * (40 << 20) + b'"}',
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["type"], r.text[:200]
    still_serving(dep, 10)


@pytest.mark.parametrize("target", ["proxy", "server"])
def test_deeply_nested_json_is_a_400_in_openai_shape(dep, target):
    url = (dep.proxy if target == "proxy" else dep.decode[0]).url
    r = httpx.post(url + "/v1/completions", content=b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                   headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "body", r.text[:300]
    still_serving(dep, 11)


def test_a_prompt_too_long_to_tokenize_is_refused_before_tokenizing(dep):
    start = time.monotonic()
    r = httpx.post(dep.decode[0].url + "/v1/completions", json={"prompt": "word " * 1_500_000}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text[:300]
    assert time.monotonic() - start < 2.0
    still_serving(dep, 12)
