"""Sustained mixed load through the proxy on a small KV budget: many concurrent requests (decode must
queue and preempt), a quarter of them cancelled mid-stream. Every finished answer is still the
transformers one and both instances end with zero leaked blocks and no lease."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from helpers import assert_greedy_match, hf_reference
from pdserve.launcher import Deployment
from servers import INSTANCE_ARGS, stats, wait_idle


@pytest.fixture(scope="module")
def busy_pair(tiny_model, tmp_path_factory):
    args = [a if a != "256" else "64" for a in INSTANCE_ARGS]  # 64 blocks of 16 tokens each
    dep = Deployment(tiny_model, [1], [2], instance_args=args,
                     log_dir=str(tmp_path_factory.mktemp("load")))
    dep.start(timeout_s=120)
    dep.model = tiny_model
    yield dep
    dep.stop()


def test_mixed_load_leaks_nothing(busy_pair):
    rng = random.Random(1234)
    jobs = []
    for _ in range(48):
        n = rng.randint(5, 120)
        ids = [1] + [rng.randrange(7, 1000) for _ in range(n - 1)]
        cancel_after = rng.randint(1, 4) if rng.random() < 0.25 else None
        jobs.append((ids, rng.randint(16, 64), cancel_after))

    async def one(client, ids, max_tokens, cancel_after):
        tokens, events = [], 0
        async with client.stream("POST", busy_pair.proxy.url + "/v1/completions",
                                 json={"prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                                       "stream": True, "return_token_ids": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for c in chunk["choices"]:
                    tokens.extend(c["token_ids"] or [])
                events += 1
                if cancel_after is not None and events >= cancel_after:
                    return None  # leave mid-stream
        return tokens

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*[one(client, *job) for job in jobs])
    results = asyncio.run(run())
    finished = 0
    for (ids, max_tokens, _), tokens in zip(jobs, results):
        if tokens is not None:
            finished += 1
            assert_greedy_match(tokens, hf_reference(busy_pair.model, ids, max_tokens), f"load len{len(ids)}")
    assert finished >= 30
    for inst in busy_pair.instances:
        s = wait_idle(inst, timeout_s=30)
        assert s["num_free_blocks"] == s["num_blocks"], (inst.role, s)
        assert s["kv_transfer"]["leases_active"] == 0
    preemptions = stats(busy_pair.decode[0])["num_preemptions"]
    print(f"decode preemptions: {preemptions}")
    assert preemptions > 0  # the budget really was too small
