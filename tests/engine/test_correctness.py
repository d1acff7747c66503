"""The engine gives transformers' greedy answers, whatever the batching, chunking, caching or TP."""

from __future__ import annotations

import random

import pytest

from helpers import assert_greedy_match, hf_reference
from pdserve import SamplingParams

BLOCK = 16


def prompt_ids(llm, n: int, seed: int) -> list[int]:
    """A prompt of exactly n tokens (BOS + n-1 random ordinary tokens)."""
    rng = random.Random(seed)
    return [1] + [rng.randrange(7, llm.engine.spec.vocab_size) for _ in range(n - 1)]


LENGTHS = [5, BLOCK, BLOCK + 1, 3 * BLOCK, 100]  # shorter than, exactly, and many blocks
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_matches_transformers(request, tiny_model, tp):
    llm = request.getfixturevalue(f"llm_tp{tp}")
    prompts = [prompt_ids(llm, n, seed=n) for n in LENGTHS]
    outs = llm.generate(prompts, GREEDY)
    for n, p, out in zip(LENGTHS, prompts, outs):
        ref = hf_reference(tiny_model, p, GREEDY.max_tokens)
        assert_greedy_match(out.outputs[0].token_ids, ref, f"tp{tp} len{n}")


def test_top_logprobs_close_to_transformers(llm_tp1, llm_tp2, tiny_model):
    """Top-5 logprobs: same token ids, values within 1e-4 absolute (float32 sums in other orders)."""
    p = prompt_ids(llm_tp1, 40, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5)
    ref = hf_reference(tiny_model, p, 8)
    for llm in (llm_tp1, llm_tp2):
        out = llm.generate([p], params)[0].outputs[0]
        assert len(out.logprobs) == len(out.token_ids)
        for step, (ours, theirs) in enumerate(zip(out.logprobs, ref.top_logprobs)):
            assert [t for t, _ in ours.top] == [t for t, _ in theirs], f"step {step}"
            for (_, a), (_, b) in zip(ours.top, theirs):
                assert abs(a - b) < 1e-4, f"step {step}: {a} vs {b}"
            assert ours.logprob == pytest.approx(ours.top[0][1]) or ours.token_id != ours.top[0][0]


def test_alone_equals_batched(llm_tp1):
    prompts = [prompt_ids(llm_tp1, n, seed=100 + n) for n in (3, 17, 33, 64, 90)]
    alone = [llm_tp1.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    batched = [o.outputs[0].token_ids for o in llm_tp1.generate(prompts, GREEDY)]
    assert alone == batched


def test_chunked_prefill_equals_whole(make_llm, tiny_model, llm_tp1):
    """A token budget of 24 splits every prompt over several steps."""
    chunked = make_llm(tiny_model, max_num_batched_tokens=24)
    prompts = [prompt_ids(llm_tp1, n, seed=200 + n) for n in (50, 100, 7)]
    whole = [o.outputs[0].token_ids for o in llm_tp1.generate(prompts, GREEDY)]
    assert [o.outputs[0].token_ids for o in chunked.generate(prompts, GREEDY)] == whole


def test_prefix_cache_hit_gives_same_answer(llm_tp1, tiny_model):
    base = prompt_ids(llm_tp1, 70, seed=300)
    first = llm_tp1.generate([base], GREEDY)[0]
    second = llm_tp1.generate([base], GREEDY)[0]
    assert second.num_cached_tokens == 64  # four full blocks; the partial one is recomputed
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    extended = base[:48] + prompt_ids(llm_tp1, 20, seed=301)[1:]
    out = llm_tp1.generate([extended], GREEDY)[0]
    assert out.num_cached_tokens == 48
    assert_greedy_match(out.outputs[0].token_ids, hf_reference(tiny_model, extended, 24), "prefix")


def test_fully_cached_block_aligned_prompt(llm_tp1, tiny_model):
    p = prompt_ids(llm_tp1, 2 * BLOCK, seed=302)
    llm_tp1.generate([p], GREEDY)
    out = llm_tp1.generate([p], GREEDY)[0]
    assert out.num_cached_tokens == BLOCK  # the last block is recomputed to produce logits
    assert_greedy_match(out.outputs[0].token_ids, hf_reference(tiny_model, p, 24), "aligned")


def test_preemption_gives_same_answers(make_llm, tiny_model, llm_tp1):
    """12 blocks for 4 requests that each grow to 4-5 blocks: the scheduler must preempt."""
    small = make_llm(tiny_model, num_blocks=12, enable_prefix_caching=False)
    prompts = [prompt_ids(llm_tp1, n, seed=400 + n) for n in (30, 31, 33, 35)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm_tp1.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in small.generate(prompts, params)]
    assert small.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert small.engine.pool.num_free_blocks == 12


def test_seeded_sampling_is_reproducible_and_batch_independent(llm_tp1):
    prompts = [prompt_ids(llm_tp1, n, seed=500 + n) for n in (10, 20)]
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=42, max_tokens=16)
    a = [o.outputs[0].token_ids for o in llm_tp1.generate(prompts, params)]
    b = [llm_tp1.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert a == b
    other = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=43, max_tokens=16)
    assert llm_tp1.generate([prompts[0]], other)[0].outputs[0].token_ids != a[0]
