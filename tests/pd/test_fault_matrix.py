"""The fault matrix on real processes (docs/design.md, "Failures"): each failure ends cleanly and
promptly, overload is waiting or a 503 (never a lost lease), and after every case every instance's
free blocks return to idle."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest

from helpers import assert_greedy_match, hf_reference, ids
from pdserve.launcher import Instance
from servers import get_json, metric, post_json, start_server, stats, wait_idle

SECRET = {"PDSERVE_KV_SECRET": "fault-matrix-secret"}
FAST = ["--kv-handshake-timeout-s", "3", "--kv-transfer-timeout-s", "2", "--drain-timeout-s", "20"]


def prefill(inst, prompt: list[int]) -> dict:
    code, body = post_json(inst.url + "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0,
                                                         "kv_transfer_params": {"do_remote_decode": True}})
    assert code == 200 and body["kv_transfer_params"], body
    return body["kv_transfer_params"]


def decode_body(prompt, kv, max_tokens=12, **kw):
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True,
            "kv_transfer_params": kv, **kw}


def assert_idle(*instances, timeout_s: float = 20.0):
    for inst in instances:
        s = wait_idle(inst, timeout_s=timeout_s)
        assert s["num_free_blocks"] == s["num_blocks"], (inst.role, s)
        assert s.get("kv_transfer", {}).get("leases_active", 0) == 0, (inst.role, s)


def leases(inst) -> int:
    return get_json(inst.url + "/debug/stats")["kv_transfer"]["leases_active"]


def proxy_for(logs, prefill_urls, decode_urls, *extra) -> Instance:
    proxy = Instance("proxy", ["proxy", "--port", "0", "--prefill", *prefill_urls, "--decode", *decode_urls, *extra])
    return proxy.spawn(logs, SECRET).wait_healthy(60)


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("fault-matrix")


@pytest.fixture(scope="module")
def producer(tiny_model, logs):
    inst = start_server(tiny_model, logs, *FAST, "--kv-lease-s", "3", role="prefill", env=SECRET)
    yield inst
    inst.stop()


@pytest.fixture(scope="module")
def decode(tiny_model, logs):
    inst = start_server(tiny_model, logs, *FAST, role="decode", env=SECRET)
    yield inst
    inst.stop()


# --- overload is waiting or a 503 ---------------------------------------------------------------

def hog(inst, max_tokens: int = 2000):
    """A streaming request that keeps `inst` busy until the returned event is set (or it ends)."""
    stop, started = threading.Event(), threading.Event()

    def run():
        with httpx.Client(timeout=120) as h:
            with h.stream("POST", inst.url + "/v1/completions",
                          json={"prompt": "occupy", "max_tokens": max_tokens, "ignore_eos": True,
                                "stream": True}) as r:
                for _ in r.iter_lines():
                    started.set()
                    if stop.is_set():
                        return
    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(30)
    return stop, t


def test_a_queue_wait_longer_than_the_lease_succeeds(tiny_model, logs):
    """Decode has one sequence slot, held for longer than the producer's 0.4 s lease: the P/D
    request waits in decode's queue; heartbeats from receipt keep the lease; then it gets its KV."""
    short = start_server(tiny_model, logs, *FAST, "--kv-lease-s", "0.4", role="prefill-short", env=SECRET)
    busy = start_server(tiny_model, logs, *FAST, "--max-num-seqs", "1", role="decode-1seq", env=SECRET)
    try:
        stop, t = hog(busy)
        p = ids(40, 1)
        kv = prefill(short, p)
        waited = {}

        def release_hog_later():
            time.sleep(1.0)  # two and a half leases (the hog alone runs longer)
            waited["at"] = time.monotonic()
            stop.set()
        threading.Thread(target=release_hog_later, daemon=True).start()
        code, body = post_json(busy.url + "/v1/completions", decode_body(p, kv), timeout=120)
        assert code == 200, body
        assert "at" in waited  # it was still queued when the hog left
        assert_greedy_match(body["choices"][0]["token_ids"], hf_reference(tiny_model, p, 12), "queued")
        t.join(30)
        assert_idle(busy, short)
    finally:
        busy.stop()
        short.stop()


def test_a_burst_over_max_pending_admits_exactly_the_limit(tiny_model, logs):
    inst = start_server(tiny_model, logs, "--max-pending", "2", role="pending2")
    try:
        codes = []

        def one():
            code, _ = post_json(inst.url + "/v1/completions",
                                {"prompt": "x", "max_tokens": 150, "ignore_eos": True}, timeout=120)
            codes.append(code)
        threads = [threading.Thread(target=one) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert sorted(codes) == [200, 200] + [503] * 6, codes
        assert_idle(inst)
    finally:
        inst.stop()


def test_a_producer_whose_blocks_are_pinned_by_leases_answers_503(tiny_model, logs):
    """16 blocks; three unread leases of 5 blocks each leave one: the next prompt is refused with
    Retry-After, not queued behind blocks no local work will free."""
    inst = start_server(tiny_model, logs, "--kv-lease-s", "60", role="pinned", num_blocks=16, env=SECRET)
    try:
        held = [prefill(inst, ids(70, 10 + i)) for i in range(3)]
        r = httpx.post(inst.url + "/v1/completions", json={"prompt": ids(70, 20), "max_tokens": 4,
                                                            "kv_transfer_params": {"do_remote_decode": True}})
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert "held for remote readers" in r.json()["error"]["message"]
        for kv in held:  # as the proxy hands back leases nobody took
            assert httpx.post(inst.url + "/kv/release", json={"kv_transfer_params": kv}).json()["released"]
        assert_idle(inst)
    finally:
        inst.stop()


def test_decode_refusing_after_prefill_releases_the_lease_at_once(tiny_model, logs, producer):
    full = start_server(tiny_model, logs, "--max-pending", "1", role="decode-full", env=SECRET)
    proxy = proxy_for(logs, [producer.url], [full.url])
    try:
        stop, t = hog(full)
        released = metric(producer, "pdserve:kv_leases_released_total")
        r = httpx.post(proxy.url + "/v1/completions", json={"prompt": ids(30, 2), "max_tokens": 8}, timeout=30)
        assert r.status_code == 503 and "busy" in r.json()["error"]["message"], r.text
        deadline = time.monotonic() + 1.0
        while leases(producer):
            assert time.monotonic() < deadline, "the producer still holds the lease"
            time.sleep(0.02)
        assert metric(producer, "pdserve:kv_leases_released_total") == released + 1
        stop.set()
        t.join(30)
        assert_idle(producer, full)
    finally:
        proxy.stop()
        full.stop()


# --- clients that leave -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def one_slot_producer(tiny_model, logs):
    inst = start_server(tiny_model, logs, *FAST, "--max-num-seqs", "1", role="prefill-1seq", env=SECRET)
    yield inst
    inst.stop()


@pytest.fixture(scope="module")
def proxy(logs, one_slot_producer, decode):
    inst = proxy_for(logs, [one_slot_producer.url], [decode.url])
    yield inst
    inst.stop()


def leave_after(url: str, body: dict, seconds: float) -> None:
    """Send a request and hang up after `seconds` without reading the answer."""
    host, port = url.removeprefix("http://").split(":")
    raw = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
        time.sleep(seconds)


@pytest.mark.parametrize("phase, stream", [("prefill", False), ("prefill", True), ("decode", False),
                                           ("decode", True)])
def test_a_client_leaving_through_the_proxy_aborts_both_legs(proxy, one_slot_producer, decode, phase, stream):
    producer = one_slot_producer
    d_prompt, d_generated = stats(decode)["num_prompt_tokens"], stats(decode)["num_generated_tokens"]
    body = {"prompt": ids(30, 4), "max_tokens": 2000, "ignore_eos": True, "stream": stream}
    if phase == "prefill":  # the producer's one slot is taken: the request waits there
        stop, t = hog(producer)
        leave_after(proxy.url, body, 0.5)
        time.sleep(0.5)  # the producer notices (it checks every 0.25 s)
        stop.set()
        t.join(30)
        assert_idle(producer, decode, timeout_s=10)
        assert stats(decode)["num_prompt_tokens"] == d_prompt  # decode never saw it
    else:  # decode steps held to 5 ms, so 2,000 tokens take 10 s whatever the machine's load
        assert post_json(decode.url + "/debug/step_delay", {"seconds": 0.005})[0] == 200
        try:
            leave_after(proxy.url, body, 0.7)  # prefill is done, decode is generating
            assert_idle(producer, decode, timeout_s=10)
        finally:
            assert post_json(decode.url + "/debug/step_delay", {"seconds": 0.0})[0] == 200
        generated = stats(decode)["num_generated_tokens"] - d_generated
        assert 0 < generated < 1000, f"decode went on without its client: {generated} tokens"


def test_a_client_leaving_around_its_hand_off_leaves_no_lease_behind(producer):
    """The client hangs up while its prefill runs; the prefill still ends in a hand-off, whose
    params nobody will ever get: the lease goes at once, not after expiry and quarantine."""
    expired = metric(producer, "pdserve:kv_leases_expired_total")
    assert post_json(producer.url + "/debug/step_delay", {"seconds": 0.5})[0] == 200
    try:
        leave_after(producer.url, {"prompt": ids(30, 6), "max_tokens": 8,
                                   "kv_transfer_params": {"do_remote_decode": True}}, 0.05)
        s = wait_idle(producer, timeout_s=2.0)  # the lease alone would hold its blocks 3 s + 4 s
    finally:
        post_json(producer.url + "/debug/step_delay", {"seconds": 0})
    assert s["num_free_blocks"] == s["num_blocks"] and s["num_quarantined_blocks"] == 0, s
    assert s["kv_transfer"]["leases_active"] == 0
    assert metric(producer, "pdserve:kv_leases_expired_total") == expired


# --- instances that die, stop or come back ------------------------------------------------------

def test_a_pool_with_a_dead_producer_serves_everything_and_the_producer_rejoins(tiny_model, logs, decode):
    live = start_server(tiny_model, logs, *FAST, role="prefill-live", env=SECRET)
    port = _free_port()
    dead = start_server(tiny_model, logs, *FAST, "--port", str(port), role="prefill-dead", env=SECRET)
    proxy = proxy_for(logs, [dead.url, live.url], [decode.url], "--probe-interval-s", "0.5")
    try:
        dead.kill()
        for i in range(6):
            p = ids(25, 40 + i)
            code, body = post_json(proxy.url + "/v1/completions",
                                   {"prompt": p, "max_tokens": 6, "temperature": 0, "return_token_ids": True})
            assert code == 200, body
            assert_greedy_match(body["choices"][0]["token_ids"], hf_reference(tiny_model, p, 6), "failover")
        dead.spawn(logs, SECRET).wait_healthy(60)  # the same address and port
        served = stats(dead)["num_prompt_tokens"]
        deadline = time.monotonic() + 15
        while stats(dead)["num_prompt_tokens"] == served:  # the proxy found it by itself
            assert time.monotonic() < deadline, "the restarted producer never got a request"
            post_json(proxy.url + "/v1/completions", {"prompt": ids(20, 50), "max_tokens": 4})
        assert_idle(live, dead, decode)
    finally:
        proxy.stop()
        dead.stop()
        live.stop()


def _free_port() -> int:
    """For the one test that restarts a server at the same port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_producer_restarted_at_the_same_address_is_handshaken_again(tiny_model, logs, decode):
    http_port, side_port = _free_port(), _free_port()
    args = [*FAST, "--port", str(http_port), "--side-channel-port", str(side_port)]
    first = start_server(tiny_model, logs, *args, role="prefill-restart", env=SECRET)
    try:
        for round_ in range(2):
            p = ids(33, 60 + round_)
            code, body = post_json(decode.url + "/v1/completions", decode_body(p, prefill(first, p)))
            assert code == 200, body
            assert_greedy_match(body["choices"][0]["token_ids"], hf_reference(tiny_model, p, 12), "restart")
            if round_ == 0:
                first.kill()
                first = start_server(tiny_model, logs, *args, role="prefill-restart", env=SECRET)
        assert_idle(first, decode)
    finally:
        first.stop()


def test_sigterm_on_a_producer_keeps_its_leases_until_decode_has_read(tiny_model, logs, decode):
    victim = start_server(tiny_model, logs, *FAST, role="prefill-term", env=SECRET)
    try:
        p = ids(45, 70)
        kv = prefill(victim, p)
        victim.signal(signal.SIGTERM)
        time.sleep(0.5)
        assert victim.proc.poll() is None  # still draining: a lease is open
        code, body = post_json(decode.url + "/v1/completions", decode_body(p, kv))
        assert code == 200, body
        assert_greedy_match(body["choices"][0]["token_ids"], hf_reference(tiny_model, p, 12), "drain")
        assert victim.proc.wait(20) in (0, -signal.SIGTERM)  # and then it exits (uvicorn re-raises)
        assert_idle(decode)
    finally:
        victim.stop()


@pytest.mark.parametrize("lanes", [1, 2])
def test_producer_killed_around_the_read(tiny_model, logs, lanes):
    """SIGKILL on the producer the moment decode has streamed the first token (the READ is being
    posted or in flight): the request ends with an error within the timeout, or completes if the
    bytes were already read; decode frees everything and keeps serving."""
    dec = start_server(tiny_model, logs, *FAST, "--kv-copy-lanes", str(lanes), role=f"decode-lanes{lanes}",
                       env=SECRET)
    victim = start_server(tiny_model, logs, *FAST, role="prefill-victim", env=SECRET)
    try:
        p = ids(1200, 80 + lanes)
        kv = prefill(victim, p)
        start = time.monotonic()
        events = []
        with httpx.Client(timeout=60) as h:
            with h.stream("POST", dec.url + "/v1/completions", json=decode_body(p, kv, stream=True)) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        if not events:
                            victim.kill()
                        events.append(json.loads(line[6:]))
        assert time.monotonic() - start < 15
        finished = events[-1]["choices"][0].get("finish_reason") if "choices" in events[-1] else None
        assert "error" in events[-1] or finished == "length", events[-1]
        code, _ = post_json(dec.url + "/v1/completions", {"prompt": "still here", "max_tokens": 4})
        assert code == 200
        assert_idle(dec)
    finally:
        victim.stop()
        dec.stop()


def test_producer_stopped_around_the_read(tiny_model, logs):
    """SIGSTOP on the producer: the READ (one-sided) may still complete; otherwise the request
    fails within the timeouts. After SIGCONT, both sides return to idle."""
    dec = start_server(tiny_model, logs, *FAST, role="decode-stop", env=SECRET)
    victim = start_server(tiny_model, logs, *FAST, "--kv-lease-s", "3", role="prefill-stopped", env=SECRET)
    try:
        p = ids(600, 90)
        kv = prefill(victim, p)
        victim.signal(signal.SIGSTOP)
        start = time.monotonic()
        code, body = post_json(dec.url + "/v1/completions", decode_body(p, kv), timeout=60)
        assert time.monotonic() - start < 15
        assert code == 200 or "error" in body, body
        victim.signal(signal.SIGCONT)
        assert_idle(dec, victim, timeout_s=30)
    finally:
        victim.signal(signal.SIGCONT)
        victim.stop()
        dec.stop()


def test_consumer_killed_around_the_read_frees_the_producer(tiny_model, logs, producer):
    """SIGKILL on decode right after its first token: the producer frees the blocks, at the latest
    after lease (3 s) + quarantine (2 x transfer timeout = 4 s)."""
    victim = start_server(tiny_model, logs, *FAST, role="decode-victim", env=SECRET)
    try:
        p = ids(600, 95)
        kv = prefill(producer, p)
        with httpx.Client(timeout=30) as h:
            with h.stream("POST", victim.url + "/v1/completions", json=decode_body(p, kv, stream=True)) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        victim.kill()
                        break
        assert_idle(producer, timeout_s=3 + 4 + 5)
    finally:
        victim.stop()


def test_ucx_over_tcp_is_loud_and_still_correct(tiny_model, logs):
    env = {**SECRET, "UCX_TLS": "tcp"}
    p_inst = start_server(tiny_model, logs, *FAST, role="prefill-tcp", env=env)
    d_inst = start_server(tiny_model, logs, *FAST, role="decode-tcp", env=env)
    try:
        p = ids(50, 99)
        code, body = post_json(d_inst.url + "/v1/completions", decode_body(p, prefill(p_inst, p)))
        assert code == 200, body
        assert_greedy_match(body["choices"][0]["token_ids"], hf_reference(tiny_model, p, 12), "tcp")
        warnings = get_json(d_inst.url + "/health")["warnings"]
        assert warnings and "UCX_TLS=tcp" in warnings[0], warnings
        assert metric(d_inst, "pdserve:kv_transfer_warnings") >= 1
        assert_idle(p_inst, d_inst)
    finally:
        p_inst.stop()
        d_inst.stop()
