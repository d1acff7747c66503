"""Scheduler: admission against `--max-num-seqs`, and which cached blocks a P/D consumer shares, on a
BlockPool and Scheduler directly."""

from __future__ import annotations

import dataclasses

from pdserve.config import SchedulerConfig
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler
from pdserve.kv_transfer.params import FirstToken, KVTransferParams
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
        s.remote_kv_loaded(r)
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
