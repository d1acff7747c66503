"""bfloat16 KV on both sides of a real NIXL P/D pair: greedy answers equal one instance's with the
same KV dtype, and the READ moves half the bytes float32 KV would."""

from __future__ import annotations

import random

from servers import metric, post_json, start_deployment, start_server, stats, wait_idle

MAX_TOKENS = 12
FLOAT32_BLOCK_BYTES = 2 * 2 * 2 * 16 * 32 * 4  # tiny: layers x K/V x KV heads x block_size x head_dim x 4


def completion(url: str, ids: list[int]) -> list[int]:
    code, body = post_json(url + "/v1/completions", {"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                     "return_token_ids": True})
    assert code == 200, body
    return body["choices"][0]["token_ids"]


def test_bfloat16_kv_pd_answers_as_one_instance_and_moves_half_the_bytes(tiny_model, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("kv-bf16")
    dep = start_deployment(tiny_model, 1, 1, log_dir, extra=["--kv-cache-dtype", "bfloat16"])
    single = None
    try:
        single = start_server(tiny_model, log_dir, "--kv-cache-dtype", "bfloat16", "--no-kv-transfer")
        rng = random.Random(22)
        prompts = [[1] + [rng.randrange(7, 1000) for _ in range(n - 1)] for n in (40, 300)]
        for ids in prompts:
            assert completion(dep.proxy.url, ids) == completion(single.url, ids), f"len {len(ids)}"
        decode = dep.decode[0]
        wait_idle(decode)
        kv = stats(decode)["kv_transfer"]
        num_blocks = kv["counters"]["kv_blocks_read"]
        assert num_blocks >= sum(len(ids) // 16 for ids in prompts)
        assert metric(decode, "pdserve:nixl_bytes_transferred_sum") == num_blocks * FLOAT32_BLOCK_BYTES // 2
    finally:
        if single is not None:
            single.stop()
        dep.stop()
