"""Prompt logprobs in the engine (chunked prefill, a cached prefix) and the other samples of a P/D
consumer waiting for its KV: on a Scheduler directly, and on one in-process engine."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import SchedulerConfig
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.request import Request, RequestStatus, TransferState
from pdserve.engine.scheduler import Scheduler
from pdserve.kv_transfer.params import FirstToken, KVTransferParams
from pdserve.sampling_params import SamplingParams
from helpers import ids

BLOCK_SIZE = 4
PROMPT = list(range(1, 11))  # two full blocks and two tokens


def _consumer(request_id: str) -> Request:
    kv = KVTransferParams(do_remote_prefill=True, remote_engine_id="p", remote_host="127.0.0.1",
                          remote_port=1, remote_block_ids=(0, 1, 2), remote_request_id=request_id,
                          producer_tp_size=1, first_token=FirstToken(7))
    return Request(request_id, PROMPT, SamplingParams(), (), 8, kv)


def _scheduler() -> Scheduler:
    return Scheduler(SchedulerConfig(), BlockPool(64, BLOCK_SIZE))


def test_other_samples_wait_for_the_consumers_kv_then_hit_the_prefix_cache():
    s = _scheduler()
    first = _consumer("s0")
    s.add(first)
    s.add(Request("s1", PROMPT, SamplingParams(seed=1), (), 8, after="s0"))
    out = s.schedule()
    assert not out.chunks and first.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert [r.request_id for r in s.waiting] == ["s1"]  # nothing of the prompt computed twice
    s.load_ended(first, TransferState.KV_LOADED)
    out = s.schedule()
    sibling = next(c for c in out.chunks if c.request_id == "s1")
    assert sibling.start_pos == 8 and sibling.token_ids == PROMPT[8:]  # two blocks from the cache


def test_other_samples_go_on_when_the_first_ended():
    s = _scheduler()
    first = _consumer("s0")
    s.add(first)
    s.add(Request("s1", PROMPT, SamplingParams(), (), 8, after="s0"))
    s.schedule()
    s.finish(first, RequestStatus.FINISHED_ABORTED)
    out = s.schedule()
    assert [c.request_id for c in out.chunks] == ["s1"] and out.chunks[0].start_pos == 0


def test_a_request_scoring_its_prompt_skips_the_prefix_cache_and_names_its_targets():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=6), BlockPool(64, BLOCK_SIZE))
    warm = Request("warm", PROMPT, SamplingParams(), (), 8)
    s.add(warm)
    while warm.num_computed_tokens < len(PROMPT):
        s.advance(s.schedule())
    scored = Request("scored", PROMPT, SamplingParams(prompt_logprobs=2), (), 8)
    s.add(scored)
    chunks = []
    while scored.num_computed_tokens < len(PROMPT):
        out = s.schedule()
        chunks += [c for c in out.chunks if c.request_id == "scored"]
        s.advance(out)
    assert chunks[0].start_pos == 0 and scored.num_cached_tokens == 0
    targets = [t for c in chunks for t in c.prompt_targets]
    assert targets == PROMPT[1:]  # each prompt token after the first, once, across the chunks
    assert all(c.num_prompt_logprobs == 2 for c in chunks)


@pytest.fixture(scope="module")
def chunked(make_llm, tiny_model):
    return make_llm(tiny_model, max_num_batched_tokens=16)


def _prompt_logprobs(engine, request_id: str, prompt: list[int]):
    engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    found = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and out.prompt_logprobs is not None:
                found = out.prompt_logprobs
    return found


def _reference(tiny_model: str, prompt: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), -1)
    return lp.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()


def test_prompt_logprobs_over_chunks_and_a_cached_prefix_are_transformers(chunked, tiny_model):
    prompt = ids(40, seed=401)  # three chunks of at most 16 tokens
    ref = _reference(tiny_model, prompt)
    engine = chunked.engine
    for run in range(2):  # the second finds the prompt's blocks cached, and computes them anyway
        entries = _prompt_logprobs(engine, f"score-{run}", prompt)
        assert entries[0] is None and len(entries) == len(prompt)
        assert max(abs(e.logprob - r) for e, r in zip(entries[1:], ref)) < 1e-4
        assert all(e.token_id == t and e.rank >= 1 and len(e.top) == 1 for e, t in zip(entries[1:], prompt[1:]))


def test_prompt_logprobs_with_the_vocabulary_split_over_two_ranks(llm_tp2, tiny_model):
    prompt = ids(30, seed=402)
    entries = _prompt_logprobs(llm_tp2.engine, "score-tp2", prompt)
    ref = _reference(tiny_model, prompt)
    assert entries[0] is None and max(abs(e.logprob - r) for e, r in zip(entries[1:], ref)) < 1e-4
