"""A decode rank with two copy lanes: READs of 1 MiB or more are split between the rank's NIXL thread
and a second agent on its own thread. Answers stay the colocated ones, the producer hears DONE once
per READ (it frees at once, no lease expires) and nothing leaks."""

from __future__ import annotations

import random
import time

import pytest

from helpers import assert_greedy_match, hf_reference
from servers import post_json, start_deployment, start_server, stats, wait_idle

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def laned(tiny_model, tmp_path_factory):
    dep = start_deployment(tiny_model, 1, 1, tmp_path_factory.mktemp("lanes"),
                           extra=["--kv-copy-lanes", "2", "--kv-lease-s", "60"])
    dep.model = tiny_model
    yield dep
    dep.stop()


@pytest.fixture(scope="module")
def laned_hetero(models_dir, tmp_path_factory):
    """P TP 2 -> D TP 1 on a 4-KV-head model (2 KiB of KV per token, 1 KiB from each producer rank):
    the decode rank splits its READ from each producer rank across its lanes."""
    from pdserve.model.tiny import make_model
    model = str(make_model(models_dir / "tiny-kv4", "tiny", num_kv_heads=4, seed=2))
    dep = start_deployment(model, 2, 1, tmp_path_factory.mktemp("lanes-hetero"),
                           extra=["--kv-copy-lanes", "2", "--kv-lease-s", "60"])
    dep.model = model
    yield dep
    dep.stop()


def test_split_reads_from_two_producer_ranks(laned_hetero):
    rng = random.Random(6)
    ids = [1] + [rng.randrange(7, 1000) for _ in range(1199)]
    code, body = post_json(laned_hetero.proxy.url + "/v1/completions",
                           {"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0,
                            "return_token_ids": True})
    assert code == 200, body
    assert_greedy_match(body["choices"][0]["token_ids"], hf_reference(laned_hetero.model, ids, MAX_TOKENS),
                        "lanes P2D1 len1200")
    for inst in laned_hetero.instances:
        s = wait_idle(inst, timeout_s=20)
        assert s["num_free_blocks"] == s["num_blocks"], (inst.role, s)
    kv = stats(laned_hetero.prefill[0])["kv_transfer"]
    assert kv["leases_active"] == 0 and kv["counters"]["kv_leases_expired"] == 0


def test_split_reads_give_colocated_answers(laned):
    rng = random.Random(5)
    # tiny: 1 KiB of KV per token, so 1,200 tokens is a 1.2 MiB READ (split) and 30 tokens is not
    for n in (1200, 30, 1500):
        ids = [1] + [rng.randrange(7, 1000) for _ in range(n - 1)]
        code, body = post_json(laned.proxy.url + "/v1/completions",
                               {"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0,
                                "return_token_ids": True})
        assert code == 200, body
        assert_greedy_match(body["choices"][0]["token_ids"], hf_reference(laned.model, ids, MAX_TOKENS),
                            f"lanes len{n}")
    prefill, decode = laned.prefill[0], laned.decode[0]
    for inst in (prefill, decode):  # well before the 60 s lease: freed by the DONE notifications
        s = wait_idle(inst, timeout_s=20)
        assert s["num_free_blocks"] == s["num_blocks"], (inst.role, s)
    kv = stats(prefill)["kv_transfer"]
    assert kv["leases_active"] == 0
    assert kv["counters"]["kv_leases_expired"] == kv["counters"]["kv_leases_released"] == 0
    assert kv["counters"]["kv_notifications_ignored"] == 0  # one DONE per READ, not one per part


def test_producer_killed_before_a_split_read(laned, tmp_path_factory):
    """The producer dies after its prefill of a READ big enough to split: the request ends with an
    error within the timeout, and the decode instance (with its lane) frees everything and keeps
    serving."""
    decode = laned.decode[0]
    victim = start_server(laned.model, tmp_path_factory.mktemp("lanes-victim"), role="victim",
                          env={"PDSERVE_KV_SECRET": laned.env["PDSERVE_KV_SECRET"]})  # one deployment
    rng = random.Random(9)
    def prefill(ids):
        code, body = post_json(victim.url + "/v1/completions",
                               {"prompt": ids, "max_tokens": 4, "temperature": 0,
                                "kv_transfer_params": {"do_remote_decode": True}})
        assert code == 200, body
        return body["kv_transfer_params"]
    try:
        warm = [1] + [rng.randrange(7, 1000) for _ in range(19)]
        code, body = post_json(decode.url + "/v1/completions",  # handshake done, agents loaded
                               {"prompt": warm, "max_tokens": 4, "kv_transfer_params": prefill(warm)})
        assert code == 200, body
        ids = [1] + [rng.randrange(7, 1000) for _ in range(1299)]
        kv = prefill(ids)
        victim.kill()
        start = time.monotonic()
        code, body = post_json(decode.url + "/v1/completions",
                               {"prompt": ids, "max_tokens": 4, "temperature": 0,
                                "kv_transfer_params": kv}, timeout=60)
        assert time.monotonic() - start < 15
        assert code != 200 or "error" in body, body
    finally:
        victim.stop()
    code, body = post_json(decode.url + "/v1/completions", {"prompt": "still here", "max_tokens": 4})
    assert code == 200, body
    s = wait_idle(decode)
    assert s["num_free_blocks"] == s["num_blocks"], s
