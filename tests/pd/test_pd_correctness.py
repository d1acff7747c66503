"""Through the proxy, P/D gives the colocated (= transformers) greedy answers for every TP pairing,
including a one-KV-head model replicated on either side; the transfer is accounted and nothing leaks.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest


from helpers import assert_greedy_match, hf_reference, ids as prompt
from pdserve.kv_transfer.topology import producer_ranks_for
from servers import get_json, metric, post_json, start_deployment, stats, wait_idle

COMBOS = [("tiny", 1, 1), ("tiny", 1, 2), ("tiny", 2, 1), ("tiny", 2, 2), ("kv1", 1, 2), ("kv1", 2, 1)]
LENGTHS = [5, 16, 100]  # shorter than a block, exactly one, many
MAX_TOKENS = 16


@pytest.fixture(scope="module", params=COMBOS, ids=[f"{m}-P{p}D{d}" for m, p, d in COMBOS])
def pd(request, tiny_model, tiny_kv1_model, tmp_path_factory):
    name, p_tp, d_tp = request.param
    model = tiny_model if name == "tiny" else tiny_kv1_model
    # every prompt through P/D (kv-aware routing would prefill a next turn on decode: test_kv_routing.py)
    dep = start_deployment(model, p_tp, d_tp, tmp_path_factory.mktemp(f"pd-{name}-{p_tp}{d_tp}"),
                           proxy_args=["--routing", "least-loaded"])
    dep.model, dep.p_tp, dep.d_tp = model, p_tp, d_tp
    yield dep
    dep.stop()


def complete(url: str, ids: list[int], **kw) -> dict:
    code, body = post_json(url + "/v1/completions", {"prompt": ids, "max_tokens": MAX_TOKENS,
                                                     "temperature": 0, "return_token_ids": True, **kw})
    assert code == 200, body
    return body


def test_greedy_equals_colocated(pd):
    for n in LENGTHS:
        ids = prompt(n, seed=n)
        body = complete(pd.proxy.url, ids)
        ours = body["choices"][0]["token_ids"]
        assert_greedy_match(ours, hf_reference(pd.model, ids, MAX_TOKENS),
                            f"P{pd.p_tp}D{pd.d_tp} len{n}")
        assert body["usage"]["prompt_tokens"] == n and body["usage"]["completion_tokens"] == len(ours)


def test_sixteen_concurrent_streams(pd):
    prompts = [prompt(10 + 7 * i, seed=1000 + i) for i in range(16)]

    async def one(client, ids):
        tokens = []
        async with client.stream("POST", pd.proxy.url + "/v1/completions",
                                 json={"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0,
                                       "stream": True, "return_token_ids": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = httpx.Response(200, content=line[6:]).json()
                    assert "error" not in chunk, chunk
                    for c in chunk["choices"]:
                        tokens.extend(c["token_ids"] or [])
        return tokens

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[one(client, p) for p in prompts])
    for ids, tokens in zip(prompts, asyncio.run(run())):
        assert_greedy_match(tokens, hf_reference(pd.model, ids, MAX_TOKENS), f"concurrent len{len(ids)}")


def test_decode_reads_the_transferred_kv(pd):
    """Perturb the producer's blocks between prefill and decode: decode's answer changes; without
    the perturbation it is the colocated one. (A prompt used nowhere else: the producer's prefix
    cache keeps the perturbed blocks.)"""
    prefill, decode = pd.prefill[0], pd.decode[0]
    answers = []
    for delta in (0.0, 4.0):
        ids = prompt(40, seed=77 if delta == 0 else 78)
        code, p = post_json(prefill.url + "/v1/completions",
                            {"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0,
                             "kv_transfer_params": {"do_remote_decode": True}})
        kv = p["kv_transfer_params"]
        assert code == 200 and kv["tp_size"] == pd.p_tp and len(kv["remote_block_ids"]) == 3
        if delta:
            post_json(prefill.url + "/debug/kv_perturb", {"block_ids": kv["remote_block_ids"],
                                                          "delta": delta})
        body = complete(decode.url, ids, kv_transfer_params=kv)
        answers.append((ids, body["choices"][0]["token_ids"]))
    (ids0, clean), (ids1, perturbed) = answers
    assert_greedy_match(clean, hf_reference(pd.model, ids0, MAX_TOKENS), "clean")
    reference = hf_reference(pd.model, ids1, MAX_TOKENS).tokens
    assert perturbed[0] == reference[0]  # the producer's own token, sampled before the perturbation
    assert perturbed != reference


def test_one_handshake_per_producer_and_no_leak(pd):
    decode, prefill = pd.decode[0], pd.prefill[0]
    for i in range(3):
        complete(pd.proxy.url, prompt(20, seed=500 + i))
    assert metric(decode, "pdserve:nixl_handshakes_total") == 1
    assert metric(decode, "pdserve:nixl_handshake_round_trips_total") == 1
    assert metric(decode, "pdserve:kv_transfers_total") >= 3
    loaded = get_json(decode.url + "/debug/loaded_peers")["ranks"]
    engine = stats(prefill)["engine_id"]
    for rank, agents in enumerate(loaded):
        wanted = producer_ranks_for(rank, pd.p_tp, pd.d_tp, 1 if "kv1" in pd.model else 2)
        assert agents == [f"{engine}/rank{r}" for r in wanted]
    for inst in (prefill, decode):
        s = wait_idle(inst)
        assert s["num_free_blocks"] == s["num_blocks"], (inst.role, s)
    assert stats(prefill)["kv_transfer"]["leases_active"] == 0
    for inst in (prefill, decode):  # every TP rank froze its start-up heap (test_proxy.py says why)
        frozen = get_json(inst.url + "/debug/gc_frozen")["ranks"]
        assert len(frozen) == inst_tp(pd, inst) and min(frozen) > 10_000, (inst.role, frozen)


def inst_tp(pd, inst) -> int:
    return pd.p_tp if inst in pd.prefill else pd.d_tp


def test_logprobs_through_the_proxy(pd):
    """The first token's logprobs come from the producer, the rest from decode: all as colocated."""
    ids = prompt(30, seed=9)
    body = complete(pd.proxy.url, ids, logprobs=3)
    ref = hf_reference(pd.model, ids, MAX_TOKENS)
    lp = body["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(body["choices"][0]["token_ids"])
    for step, (got, top, expected) in enumerate(zip(lp["token_logprobs"], lp["top_logprobs"],
                                                    ref.top_logprobs)):
        assert abs(got - expected[0][1]) < 1e-4, step  # greedy: the sampled token is the top one
        assert len(top) == 3


def test_seeded_sampling_continues_as_colocated(pd):
    """The producer samples the first token with the request's seed; decode skips that draw, so the
    whole answer equals a colocated run of the same seeded request (on the decode instance)."""
    ids = prompt(33, seed=21)
    params = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
    through_pd = complete(pd.proxy.url, ids, **params)["choices"][0]["token_ids"]
    colocated = complete(pd.decode[0].url, ids, **params)["choices"][0]["token_ids"]
    assert through_pd == colocated
    assert complete(pd.proxy.url, ids, **{**params, "seed": 99})["choices"][0]["token_ids"] != colocated


def test_sampling_controls_through_pd_as_colocated(pd):
    """The producer's first token obeys logit_bias and allowed_token_ids; decode goes on with every
    control, counting the prompt (repetition_penalty) and the producer's token (min_tokens): greedy
    through P/D equals one instance, and the controls did change the answer."""
    ids = prompt(40, seed=31)
    plain = complete(pd.decode[0].url, ids)["choices"][0]["token_ids"]
    banned, held_back = plain[0], plain[1]
    allowed = sorted(set(plain) | set(ids[1:9]))
    controls = {"logit_bias": {str(banned): -100.0}, "allowed_token_ids": allowed, "repetition_penalty": 1.5,
                "min_tokens": MAX_TOKENS, "stop_token_ids": [held_back]}
    through_pd = complete(pd.proxy.url, ids, **controls)
    colocated = complete(pd.decode[0].url, ids, **controls)["choices"][0]["token_ids"]
    tokens = through_pd["choices"][0]["token_ids"]
    assert tokens == colocated
    assert tokens[0] != banned and set(tokens) <= set(allowed) and held_back not in tokens
    assert len(tokens) == MAX_TOKENS and through_pd["choices"][0]["finish_reason"] == "length"


def test_a_next_turn_reads_only_what_decode_lacks_and_a_full_hit_reads_nothing(pd):
    """Turn 2 = turn 1's prompt + its answer + a new question: decode cached turn 1's prompt and
    answer (their full blocks), so it READs only the blocks it lacks, computes no prompt token, and
    answers as transformers does. A prompt decode holds whole READs nothing and frees the producer."""
    decode = pd.decode[0]

    def counts() -> tuple[float, float, float]:
        return (metric(decode, "pdserve:kv_blocks_read_total"),
                metric(decode, "pdserve:kv_blocks_read_skipped_total"),
                metric(decode, "pdserve:prompt_tokens_computed_total"))
    first = prompt(40, seed=500)
    answer = complete(pd.proxy.url, first)["choices"][0]["token_ids"]
    second = first + answer + prompt(20, seed=501)  # 76 tokens: four full blocks and a partial one
    read0, skipped0, computed0 = counts()
    ours = complete(pd.proxy.url, second)["choices"][0]["token_ids"]
    assert_greedy_match(ours, hf_reference(pd.model, second, MAX_TOKENS), f"P{pd.p_tp}D{pd.d_tp} turn 2")
    held = (len(first) + len(answer) - 1) // 16  # the last answer token's KV was never computed
    read1, skipped1, computed1 = counts()
    assert (skipped1 - skipped0, read1 - read0) == (held, 5 - held)
    assert computed1 == computed0
    third = second[:64]  # four full blocks, all held by decode now
    ours = complete(pd.proxy.url, third)["choices"][0]["token_ids"]
    assert_greedy_match(ours, hf_reference(pd.model, third, MAX_TOKENS), f"P{pd.p_tp}D{pd.d_tp} full hit")
    read2, skipped2, computed2 = counts()
    assert (skipped2 - skipped1, read2 - read1, computed2) == (4, 0, computed0)
    for inst in pd.instances:
        s = wait_idle(inst)
        assert s["num_free_blocks"] == s["num_blocks"], f"{inst.role} holds blocks: {s}"


def test_a_producer_that_lost_the_history_pulls_it_from_decode(pd):
    """After turn 1 the producer's prefix cache is reset (as after an eviction); decode still holds
    turn 1's prompt and answer. Turn 2's producer READs those blocks from decode (the proxy names
    decode as a holder) and computes only the rest; decode READs only the new blocks; the answer is
    transformers' and nothing stays pinned."""
    prefill, decode = pd.prefill[0], pd.decode[0]
    first = prompt(60, seed=600)
    answer = complete(pd.proxy.url, first)["choices"][0]["token_ids"]
    assert post_json(prefill.url + "/reset_prefix_cache", {})[0] == 200
    second = first + answer + prompt(20, seed=601)  # 96 tokens: six blocks
    before = [metric(prefill, n) for n in ("pdserve:kv_blocks_pulled_total",
                                           "pdserve:prompt_tokens_computed_total")]
    read0 = metric(decode, "pdserve:kv_blocks_read_total")
    ours = complete(pd.proxy.url, second)["choices"][0]["token_ids"]
    assert_greedy_match(ours, hf_reference(pd.model, second, MAX_TOKENS), f"P{pd.p_tp}D{pd.d_tp} pulled")
    held = (len(first) + len(answer) - 1) // 16  # decode computed all but the last answer token
    pulled, computed = (metric(prefill, n) - b for n, b in zip(
        ("pdserve:kv_blocks_pulled_total", "pdserve:prompt_tokens_computed_total"), before))
    assert (pulled, computed) == (held, len(second) - 16 * held)
    assert metric(decode, "pdserve:kv_blocks_read_total") - read0 == 6 - held
    assert metric(decode, "pdserve:kv_blocks_claimed_total") >= held
    for inst in pd.instances:
        s = wait_idle(inst)
        assert s["num_free_blocks"] == s["num_blocks"], f"{inst.role} holds blocks: {s}"


def test_an_edited_history_reuses_exactly_the_blocks_before_the_edit(pd):
    """A later turn whose history was rewritten from its third block on: decode reuses the two
    blocks before the edit and READs every block after it (by content, never by position)."""
    decode = pd.decode[0]
    first = prompt(64, seed=700)
    complete(pd.proxy.url, first)  # decode now holds these four blocks
    edited = first[:32] + prompt(32, seed=701) + prompt(20, seed=702)  # 84 tokens: six blocks
    read0, skipped0 = (metric(decode, "pdserve:kv_blocks_read_total"),
                       metric(decode, "pdserve:kv_blocks_read_skipped_total"))
    ours = complete(pd.proxy.url, edited)["choices"][0]["token_ids"]
    assert_greedy_match(ours, hf_reference(pd.model, edited, MAX_TOKENS), f"P{pd.p_tp}D{pd.d_tp} edited")
    assert (metric(decode, "pdserve:kv_blocks_read_skipped_total") - skipped0,
            metric(decode, "pdserve:kv_blocks_read_total") - read0) == (2, 4)
