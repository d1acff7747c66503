"""Scheduler: admission against `--max-num-seqs`, which cached blocks a P/D consumer shares, what the
end of a remote load (or a producer's pull) means for scheduling, on a BlockPool and Scheduler
directly."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.config import SchedulerConfig
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.request import Request, RequestStatus, TransferState
from pdserve.engine.scheduler import Scheduler
from pdserve.kv_transfer.params import FirstToken, Holder, KVTransferParams
from pdserve.prefix_cache.hashing import hash_blocks, wire_hash
from pdserve.sampling_params import SamplingParams

BLOCK_SIZE = 4


def _local(request_id: str) -> Request:
    return Request(request_id, [1, 2, 3, 4, 5], SamplingParams(), (), 8)


def _remote(request_id: str) -> Request:
    """A P/D consumer request: its prompt's KV comes from a producer."""
    kv = KVTransferParams(do_remote_prefill=True, remote_engine_id="p", remote_host="127.0.0.1",
                          remote_port=1, remote_block_ids=(0, 1), remote_request_id=request_id,
                          producer_tp_size=1, first_token=FirstToken(7))
    return Request(request_id, [1, 2, 3, 4, 5], SamplingParams(), (), 8, kv)


def _scheduler(max_num_seqs: int) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs), BlockPool(64, BLOCK_SIZE))


def _num_admitted(s: Scheduler) -> int:
    return len(s.running) + len(s.loading)


def test_requests_loading_remote_kv_count_against_max_num_seqs_for_local_ones():
    s = _scheduler(max_num_seqs=2)
    s.add(_remote("remote-0"))
    s.add(_remote("remote-1"))
    s.schedule()
    assert [r.status for r in s.loading] == [RequestStatus.WAITING_FOR_REMOTE_KV] * 2
    s.add(_local("local"))
    out = s.schedule()
    assert not out.chunks and _num_admitted(s) == 2  # the local one waits for a slot
    for r in list(s.loading):  # the loads land: running never exceeds the limit
        s.load_ended(r, TransferState.KV_LOADED)
    assert len(s.running) == 2
    s.finish(s.running[0], RequestStatus.FINISHED_STOPPED)
    out = s.schedule()
    assert [c.request_id for c in out.chunks if c.request_id == "local"] == ["local"]
    assert len(s.running) == 2


def test_remote_requests_count_running_and_loading_ones():
    s = _scheduler(max_num_seqs=2)
    s.add(_local("local"))
    s.add(_remote("remote-0"))
    s.add(_remote("remote-1"))
    s.schedule()
    assert _num_admitted(s) == 2 and [r.request_id for r in s.waiting] == ["remote-1"]


# --- delta reads: a P/D consumer shares the prompt blocks it caches where the hashes agree ----------

PROMPT = list(range(100, 116))  # four full blocks


def _cached(s: Scheduler, tokens: list[int], salt: str | None = None) -> list[int]:
    """Prefill `tokens` here and finish: their full blocks stay in the prefix cache."""
    r = Request(f"local-{len(s.pool.cached)}", tokens, SamplingParams(), (), 8, cache_salt=salt)
    s.add(r)
    s.advance(s.schedule())
    blocks = list(r.block_ids)
    s.finish(r, RequestStatus.FINISHED_STOPPED)
    return blocks


def _consumer(request_id: str, prompt: list[int], their_keys: tuple[str, ...] = ("m",),
              salt: str | None = None) -> Request:
    hashes = tuple(wire_hash(h) for h in hash_blocks(prompt, BLOCK_SIZE, their_keys))
    kv = KVTransferParams(do_remote_prefill=True, remote_engine_id="p", remote_host="127.0.0.1",
                          remote_port=1, remote_block_ids=tuple(range(-(-len(prompt) // BLOCK_SIZE))),
                          remote_request_id=request_id, producer_tp_size=1, first_token=FirstToken(7),
                          block_hashes=hashes)
    r = Request(request_id, prompt, SamplingParams(), (), 8, kv, cache_salt=salt)
    r.output_token_ids.append(7)  # the producer's first token arrives with the params
    return r


def _delta_scheduler() -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8), BlockPool(16, BLOCK_SIZE, model_key="m"))


def test_a_consumer_shares_the_cached_blocks_whose_hashes_agree():
    s = _delta_scheduler()
    held = _cached(s, PROMPT + [1, 2])
    r = _consumer("d", PROMPT + [5, 6])  # the same four blocks, another tail
    s.add(r)
    (load,) = s.schedule().remote_loads
    assert load.num_cached_blocks == 4 and load.block_ids[:4] == held[:4]
    assert len(load.block_ids) == 5  # the partial last block and the first token's slot: new
    assert r.num_cached_tokens == 16 and s.num_prefix_cache_hits == 16
    others = s.pool.allocate(s.pool.num_free_blocks)  # an eviction after the match takes none of them
    assert not set(others) & set(load.block_ids)


def test_an_edited_history_reuses_exactly_the_matching_chain():
    s = _delta_scheduler()
    _cached(s, PROMPT + [1])
    edited = PROMPT[:8] + [9, 9, 9, 9] + PROMPT[12:] + [1]  # the third block rewritten
    r = _consumer("d", edited)
    s.add(r)
    (load,) = s.schedule().remote_loads
    assert load.num_cached_blocks == 2  # blocks 0-1; block 3 matches by position, not by chain


def test_hashes_that_disagree_share_nothing():
    s = _delta_scheduler()
    _cached(s, PROMPT + [1])
    r = _consumer("d", PROMPT + [1], their_keys=("m", "another-tenant"))  # the producer's salt differs
    s.add(r)
    assert s.schedule().remote_loads[0].num_cached_blocks == 0


def test_a_salted_consumer_never_shares_another_salts_blocks():
    s = _delta_scheduler()
    _cached(s, PROMPT + [1], salt="tenant-a")
    r = _consumer("d", PROMPT + [1], their_keys=("m", "tenant-b"), salt="tenant-b")
    s.add(r)
    assert s.schedule().remote_loads[0].num_cached_blocks == 0


def test_params_without_hashes_share_nothing():
    s = _delta_scheduler()
    _cached(s, PROMPT + [1])
    r = _consumer("d", PROMPT + [1])
    r.kv_transfer = dataclasses.replace(r.kv_transfer, block_hashes=None)
    s.add(r)
    assert s.schedule().remote_loads[0].num_cached_blocks == 0


# --- how a remote load ends: what the engine applies from the connector's outcome --------------------

def test_a_loaded_request_runs_from_its_first_generated_token():
    s = _delta_scheduler()
    r = _consumer("d", PROMPT + [5, 6])
    s.add(r)
    out = s.schedule()
    assert [l.request_id for l in out.remote_loads] == ["d"] and not out.chunks
    assert r.transfer == TransferState.AWAITING_KV and r.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert not s.schedule().chunks  # never scheduled while its KV is in flight
    s.load_ended(r, TransferState.KV_LOADED)
    assert r.transfer == TransferState.KV_LOADED and r.status == RequestStatus.RUNNING
    (chunk,) = s.schedule().chunks
    assert chunk.token_ids == [7] and chunk.start_pos == len(PROMPT) + 2 and chunk.sample
    assert s.pool.cached  # the loaded prompt's full blocks serve later requests too


def test_a_load_ending_in_recompute_frees_its_blocks_and_prefills_first_in_line():
    s = _delta_scheduler()
    r = _consumer("d", PROMPT + [5, 6])
    s.add(r)
    s.schedule()
    s.add(Request("local", [1, 2, 3], SamplingParams(), (), 8))
    free = s.pool.num_free_blocks
    s.load_ended(r, TransferState.RECOMPUTING)
    assert r.transfer == TransferState.RECOMPUTING and s.pool.num_free_blocks == free + 5
    assert [w.request_id for w in s.waiting] == ["d", "local"]
    chunks = s.schedule().chunks
    assert chunks[0].request_id == "d" and chunks[0].start_pos == 0
    assert chunks[0].token_ids == PROMPT + [5, 6, 7]  # the prompt and the producer's token, computed here
    assert not s.loading


def test_a_queued_request_told_to_recompute_is_admitted_as_a_local_one():
    s = _scheduler(max_num_seqs=1)
    s.add(_local("local"))
    r = _consumer("d", PROMPT)
    s.add(r)
    s.schedule()  # "local" holds the only slot: "d" stays queued, no blocks
    s.load_ended(r, TransferState.RECOMPUTING)
    assert r.status == RequestStatus.WAITING and r.transfer == TransferState.RECOMPUTING
    s.finish(s.running[0], RequestStatus.FINISHED_STOPPED)
    out = s.schedule()
    assert not out.remote_loads and [c.request_id for c in out.chunks] == ["d"]


def test_illegal_transfer_transitions_are_our_bug():
    s = _delta_scheduler()
    r = _consumer("d", PROMPT)
    s.add(r)
    s.schedule()
    s.load_ended(r, TransferState.KV_LOADED)
    with pytest.raises(AssertionError):
        r.move_transfer_to(TransferState.RECOMPUTING)  # a load ends once
    with pytest.raises(AssertionError):
        s.load_ended(r, TransferState.FAILED)  # the engine ends the request itself


# --- pulls: a producer reads the prompt blocks a holder caches instead of computing them ----------

HOLDER = Holder("D", "127.0.0.1", 5600, 1)


def _producer(request_id: str, prompt: list[int]) -> Request:
    kv = KVTransferParams(do_remote_decode=True, kv_holders=(HOLDER,))
    return Request(request_id, prompt, SamplingParams(), (), 8, kv)


def _pull_scheduler(min_tokens: int = 8) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, kv_pull_min_tokens=min_tokens),
                     BlockPool(16, BLOCK_SIZE, model_key="m"))


def test_a_pull_asks_for_the_full_blocks_this_instance_lacks():
    s = _pull_scheduler()
    _cached(s, PROMPT[:4] + [1])  # the first block is cached here
    r = _producer("p", PROMPT + [1])
    s.add(r)
    out = s.schedule()
    (pull,) = out.remote_pulls
    assert not out.chunks and r.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert len(pull.block_ids) == 3 and pull.holders == (HOLDER,)
    assert pull.block_hashes == s.pool.block_hashes(r, 4)[1:]  # by content hash, after the cached one
    assert r.num_computed_tokens == BLOCK_SIZE


def test_a_pull_that_read_some_blocks_computes_only_the_rest():
    s = _pull_scheduler()
    r = _producer("p", PROMPT + [1])
    s.add(r)
    s.schedule()
    s.load_ended(r, TransferState.KV_LOADED, num_blocks=2)  # the holder had two of the four
    assert r.transfer == TransferState.PRODUCING and r.status == RequestStatus.RUNNING
    (chunk,) = s.schedule().chunks
    assert chunk.start_pos == 2 * BLOCK_SIZE and chunk.token_ids == PROMPT[8:] + [1]


def test_a_request_served_here_pulls_too_and_stays_served_here():
    """A decode instance prefilling a prompt itself, named holders by a kv-aware proxy."""
    s = _pull_scheduler()
    r = Request("d", PROMPT + [1], SamplingParams(), (), 8, KVTransferParams(kv_holders=(HOLDER,)))
    s.add(r)
    (pull,) = s.schedule().remote_pulls
    s.load_ended(r, TransferState.KV_LOADED, num_blocks=3)
    assert r.transfer == TransferState.NONE and r.status == RequestStatus.RUNNING
    (chunk,) = s.schedule().chunks
    assert chunk.start_pos == 3 * BLOCK_SIZE and chunk.token_ids == PROMPT[12:] + [1]


def test_a_failed_pull_computes_everything_and_is_not_tried_again():
    s = _pull_scheduler()
    r = _producer("p", PROMPT + [1])
    s.add(r)
    s.schedule()
    s.load_ended(r, TransferState.RECOMPUTING)
    assert r.transfer == TransferState.PRODUCING and not r.block_ids
    out = s.schedule()
    assert not out.remote_pulls and out.chunks[0].start_pos == 0 and out.chunks[0].token_ids == PROMPT + [1]


def test_a_short_gap_is_computed_not_pulled():
    s = _pull_scheduler(min_tokens=5 * BLOCK_SIZE)
    s.add(_producer("p", PROMPT + [1]))
    out = s.schedule()
    assert not out.remote_pulls and out.chunks[0].request_id == "p"


def test_a_pull_counts_its_prompt_once_and_what_it_read_as_hits():
    s = _pull_scheduler()
    r = _producer("p", PROMPT + [1])
    s.add(r)
    s.schedule()
    assert s.num_prefix_cache_queries == 17 and s.num_prefix_cache_hits == 0
    s.load_ended(r, TransferState.KV_LOADED, num_blocks=2)  # found in the holder's cache
    assert s.num_prefix_cache_hits == 2 * BLOCK_SIZE
    assert r.num_cached_tokens == 2 * BLOCK_SIZE  # usage's cached_tokens: not computed here
    r2 = _producer("q", [9] * 17)
    s.add(r2)
    s.schedule()
    s.load_ended(r2, TransferState.RECOMPUTING)  # nobody held any: computed here, not asked again
    s.schedule()
    assert r2.num_cached_tokens == 0
    assert s.num_prefix_cache_queries == 34 and s.num_prefix_cache_hits == 2 * BLOCK_SIZE


def test_siblings_sharing_an_uncached_prefix_compute_it_once():
    """Two requests that arrive together with the same 12-token prefix: the second waits one step
    for the first to compute the prefix, then finds it cached (a third, unrelated one is not held)."""
    s = Scheduler(SchedulerConfig(max_num_seqs=8), BlockPool(64, BLOCK_SIZE))
    prefix = list(range(100, 112))  # 3 full blocks
    s.add(Request("a", prefix + [1, 2], SamplingParams(), (), 8))
    s.add(Request("b", prefix + [3, 4, 5], SamplingParams(), (), 8))
    s.add(Request("c", list(range(200, 214)), SamplingParams(), (), 8))
    out = s.schedule()
    assert sorted(c.request_id for c in out.chunks) == ["a", "c"]
    s.advance(out)
    out = s.schedule()
    b = next(c for c in out.chunks if c.request_id == "b")
    assert b.start_pos == 12 and b.token_ids == [3, 4, 5]  # the prefix came from the cache
    assert s.requests["b"].num_cached_tokens == 12
    s.advance(out)
    assert s.num_prompt_tokens_computed == 14 + 3 + 14


# --- a prefill's stall on the streams a decode instance runs ---------------------------------------

def _streaming_scheduler(max_prefill_stall_s: float, rate: float = 100.0) -> Scheduler:
    """A scheduler running one stream (a loaded consumer request), measured at `rate` prompt tokens/s."""
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_prefill_stall_s=max_prefill_stall_s),
                  BlockPool(64, BLOCK_SIZE, model_key="m"))
    s.prefill_tokens_per_s = rate
    stream = _consumer("stream", PROMPT)
    s.add(stream)
    s.schedule()
    s.load_ended(stream, TransferState.KV_LOADED)
    return s


def _chunk_sizes(s: Scheduler) -> dict[str, int]:
    """One step's prompt or generated tokens per request; each chunk that samples gets its token."""
    out = s.schedule()
    s.advance(out)
    for chunk in out.chunks:
        if chunk.sample:
            s.requests[chunk.request_id].output_token_ids.append(9)
    return {c.request_id: len(c.token_ids) for c in out.chunks}


def test_a_prompt_is_prefilled_beside_streams_in_steps_of_the_stall_budget():
    s = _streaming_scheduler(0.1)  # 0.1 s at 100 tokens/s: 10 prompt tokens a step
    s.add(Request("turn", list(range(200, 240)), SamplingParams(), (), 8))
    assert _chunk_sizes(s) == {"stream": 1, "turn": 10}
    assert _chunk_sizes(s) == {"stream": 1, "turn": 10}  # the stream's next token comes every step
    s.prefill_tokens_per_s = 400.0  # measured faster: 40 a step
    assert _chunk_sizes(s) == {"stream": 1, "turn": 20}  # the rest


def test_without_streams_or_a_budget_a_prompt_is_prefilled_at_once():
    s = _streaming_scheduler(0.0)
    s.add(Request("turn", list(range(200, 240)), SamplingParams(), (), 8))
    assert _chunk_sizes(s) == {"stream": 1, "turn": 40}
    idle = Scheduler(SchedulerConfig(max_prefill_stall_s=0.1), BlockPool(64, BLOCK_SIZE))
    idle.prefill_tokens_per_s = 100.0
    idle.add(Request("turn", list(range(200, 240)), SamplingParams(), (), 8))
    assert _chunk_sizes(idle) == {"turn": 40}  # nothing to stall


def test_the_stall_budget_never_drops_below_a_block_a_step():
    s = _streaming_scheduler(0.1, rate=5.0)  # half a token in 0.1 s
    s.add(Request("turn", list(range(200, 240)), SamplingParams(), (), 8))
    assert _chunk_sizes(s) == {"stream": 1, "turn": BLOCK_SIZE}
