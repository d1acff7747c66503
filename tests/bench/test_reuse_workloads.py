"""Workloads that reuse (multi-turn, shared-prefix, a Mooncake trace), the LRU bound on a sequence
worked by hand, and the instances' counters as the benchmark reads them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.bench.datasets import DatasetArgs, MultiTurnArgs, SharedPrefixArgs, TraceArgs, build, make
from pdserve.bench.instance_counters import delta, parse, summarize
from pdserve.bench.lru_bound import LRUBound
from pdserve.bench.trace import block_ids, read_trace

TINY_TRACE = Path(__file__).parent / "data" / "tiny_trace.jsonl"


def multi_turn(**kw) -> DatasetArgs:
    mt = dict(num_sessions=3, num_turns=4, system_len=32, user_len=8, answer_len=5, think_time_s=0.5)
    return DatasetArgs(name="multi-turn", seed=2, multi_turn=MultiTurnArgs(**{**mt, **kw}))


def test_multi_turn_sessions_grow_by_each_answer_and_turn():
    reqs = make(multi_turn())
    assert reqs == make(multi_turn()) and reqs != make(DatasetArgs(**{**multi_turn().__dict__, "seed": 3}))
    assert [r.session_id for r in reqs] == [f"session-{s}" for s in range(3) for _ in range(4)]
    for s in range(3):
        turns = reqs[4 * s:4 * s + 4]
        assert len(turns[0].prompt) == turns[0].prompt_len == 32 + 8 and not turns[0].with_history
        assert turns[0].think_time_s == 0
        for prev, turn in zip(turns, turns[1:]):
            assert turn.with_history and len(turn.prompt) == 8  # only the new user tokens
            assert turn.prompt_len == prev.prompt_len + 5 + 8  # history: the previous prompt and answer
            assert turn.output_len == 5 and turn.think_time_s > 0
    assert len({tuple(reqs[4 * s].prompt[:32]) for s in range(3)}) == 3  # each session its own system prompt
    thinks = [r.think_time_s for r in make(multi_turn(num_sessions=300, think_time_s=2.0)) if r.with_history]
    assert 1.8 < sum(thinks) / len(thinks) < 2.2 and max(thinks) > 3 * min(thinks)  # exponential, mean 2
    assert {r.think_time_s for r in make(multi_turn(think_time_dist="fixed")) if r.with_history} == {0.5}


def test_multi_turn_arguments_are_checked():
    with pytest.raises(ValueError, match="max-model-len"):
        make(DatasetArgs(name="multi-turn", max_len=100, multi_turn=MultiTurnArgs(num_turns=4, system_len=64)))
    with pytest.raises(ValueError, match="--multi-turn-num-turns"):
        MultiTurnArgs(num_turns=0)
    with pytest.raises(ValueError, match="think-time-dist"):
        MultiTurnArgs(think_time_dist="uniform")


def test_shared_prefix_groups_as_inference_perf():
    args = DatasetArgs(name="shared-prefix", seed=1, shared_prefix=SharedPrefixArgs(
        num_groups=3, prompts_per_group=5, system_len=40, question_len=12, output_len=7))
    reqs = make(args)
    assert reqs == make(args) and len(reqs) == 15
    assert {(r.prompt_len, len(r.prompt), r.output_len) for r in reqs} == {(52, 52, 7)}
    groups = [tuple(r.prompt[:40]) for r in reqs]
    assert sorted(groups.count(g) for g in set(groups)) == [5, 5, 5]
    assert len({tuple(r.prompt) for r in reqs}) == 15
    assert groups[:5] != [groups[0]] * 5 or groups[5:10] != [groups[5]] * 5  # shuffled, not group by group


def test_trace_rows_parse_and_malformed_ones_are_counted():
    rows, skipped = read_trace(TINY_TRACE)
    assert skipped == 8 and len(rows) == 6  # the blank line is neither
    assert [r.timestamp_ms for r in rows] == [0, 100, 200, 300, 500, 700]
    assert [r.session_id for r in rows] == [None, None, "a", "a", None, None]
    assert rows[3].hash_ids == (4, 5, 6) and rows[3].input_length == 1500
    with pytest.raises(ValueError, match="no-such"):
        read_trace("/no-such/trace.jsonl")


def test_trace_blocks_are_fixed_per_hash_id(tmp_path):
    reqs = build(DatasetArgs(name="trace", path=str(TINY_TRACE), num_prompts=None)).requests
    ids = [r.prompt.ids() for r in reqs]
    assert [r.prompt_len for r in reqs] == [len(x) for x in ids] == [1200, 1400, 700, 1500, 1024, 2000]
    assert ids[0][:1024] == ids[1][:1024] == ids[4] == ids[5][:1024]  # hash ids 0, 1 in common
    assert ids[0][1024:1200] == ids[5][1024:1200] and ids[0][1024:1030] != ids[1][1024:1030]  # 2 vs 3
    assert ids[3][:700] == ids[2]  # session a's second turn extends its first
    assert ids[5][1536:] != ids[0][:464]  # hash id 7
    assert ids[0][:512] == list(block_ids(0, 512, 7, 1000))  # the id alone decides (other seed, same)
    other = build(DatasetArgs(name="trace", path=str(TINY_TRACE), num_prompts=None, seed=9)).requests
    assert other[1].prompt.ids() == ids[1]
    # fewer blocks than the length: the rest is the row's own tokens
    path = tmp_path / "short.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [0]}\n'
                    '{"timestamp": 1, "input_length": 600, "output_length": 2, "hash_ids": [0]}\n')
    a, b = (r.prompt.ids() for r in make(DatasetArgs(name="trace", path=str(path), num_prompts=None)))
    assert len(a) == len(b) == 600 and a[:512] == b[:512] and a[512:] != b[512:]


def test_trace_scaling_of_blocks_lengths_and_time():
    args = DatasetArgs(name="trace", path=str(TINY_TRACE), num_prompts=None, max_len=4096,
                       trace=TraceArgs(block_tokens=16, time_scale=0.5))
    reqs = make(args)
    assert [r.prompt_len for r in reqs] == [38, 44, 22, 47, 32, 63]  # x 16/512, rounded up
    assert [r.arrival_s for r in reqs] == pytest.approx([0, 0.05, 0.1, 0.15, 0.25, 0.35])
    ids = [r.prompt.ids() for r in reqs]
    assert ids[0][:32] == ids[1][:32] == ids[4] and ids[0][32:38] != ids[1][32:38]  # 16-token blocks
    capped = make(DatasetArgs(**{**args.__dict__, "trace": TraceArgs(block_tokens=16, max_input_len=40)}))
    assert [r.prompt_len for r in capped] == [38, 40, 22, 40, 32, 40]
    assert capped[5].prompt.ids() == ids[5][:40]
    assert [r.output_len for r in capped] == [4] * 6
    assert len(make(DatasetArgs(**{**args.__dict__, "num_prompts": 2}))) == 2


def test_any_file_in_the_format_runs(tmp_path):
    path = tmp_path / "odd.jsonl"
    path.write_bytes(b'\xff\xfe garbage\n{"timestamp": 5, "input_length": 3, "output_length": 1, "hash_ids": []}\n'
                     b'{"timestamp": 1e3, "input_length": 9000, "output_length": 9000, "hash_ids": [-1, 99999999999]}\n'
                     b'{"a": {"b": [[[[[]]]]]}}\n{}\n')
    w = build(DatasetArgs(name="trace", path=str(path), num_prompts=None, max_len=2048))
    assert w.info == {"trace_rows": 2, "trace_rows_skipped": 3}
    assert [(r.prompt_len, r.output_len) for r in w.requests] == [(3, 1), (2046, 2)]  # within --max-model-len
    assert [len(r.prompt.ids()) for r in w.requests] == [3, 2046]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("nothing\n")
    assert build(DatasetArgs(name="trace", path=str(empty), num_prompts=None)).requests == []


def test_lru_bound_by_hand():
    """Blocks of 2 tokens, room for 3. A = [1 2 | 3 4 | 5]: both blocks miss, both stored. B = [1 2 |
    3 4 | 9]: 4 tokens hit. C = [7 8 | 1 2 | 3]: misses; storing its 2 blocks evicts the least
    recent, A's tail [3 4] (a request's head is its most recent block). D = [1 2 | 3 4 | 6]: [1 2]
    hits, [3 4] was evicted: 2 tokens. 6 of 20 tokens; with no eviction 8 of 20."""
    seq = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 9], [7, 8, 1, 2, 3], [1, 2, 3, 4, 6]]
    lru, unbounded = LRUBound(3, block_size=2), LRUBound(None, block_size=2)
    assert [lru.lookup(p) for p in seq] == [0, 4, 0, 2]
    assert [unbounded.lookup(p) for p in seq] == [0, 4, 0, 4]
    assert lru.hit_rate == pytest.approx(6 / 20) and unbounded.hit_rate == pytest.approx(8 / 20)
    whole = LRUBound(None, block_size=2)  # a prompt all in full blocks: its last token is computed
    whole.lookup([1, 2, 3, 4])
    assert whole.lookup([1, 2, 3, 4]) == 2
    answered = LRUBound(None, block_size=2)  # a stored answer (multi-turn) is reused by the next turn
    answered.lookup([1, 2, 3])
    answered.store([1, 2, 3, 50, 51])
    assert answered.lookup([1, 2, 3, 50, 51, 60, 61]) == 4
    assert LRUBound(0, 2).lookup([1, 2, 3]) == 0 and LRUBound(0, 2).hit_rate == 0
    with pytest.raises(ValueError, match="--lru-bound-blocks"):
        LRUBound(-1)


METRICS = """# HELP pdserve:prefix_cache_hits_total Prompt tokens found in the prefix cache (vLLM's).
# TYPE pdserve:prefix_cache_hits_total counter
pdserve:prefix_cache_hits_total{model_name="tiny"} %d
pdserve:prefix_cache_queries_total{model_name="tiny"} %d
pdserve:prompt_tokens_computed_total{model_name="tiny"} %d
pdserve:nixl_bytes_transferred_sum{model_name="tiny"} %d
pdserve:nixl_bytes_transferred_count{model_name="tiny"} 3.0
"""


def test_counters_are_the_difference_summed_over_instances():
    p0, p1 = parse(METRICS % (0, 100, 100, 0)), parse(METRICS % (64, 300, 236, 0))
    d0, d1 = parse(METRICS % (16, 50, 0, 1000)), parse(METRICS % (144, 250, 0, 5096))
    assert p1 == {"prefix_cache_hits": 64, "prefix_cache_queries": 300, "prompt_tokens_computed": 236,
                  "kv_bytes_transferred": 0}
    deltas = delta({"p": p0, "d": d0, "gone": None, "vllm": {}}, {"p": p1, "d": d1, "gone": None, "vllm": {}})
    assert deltas["p"]["prompt_tokens_computed"] == 136 and deltas["gone"] is None and deltas["vllm"] == {}
    out = summarize(deltas, prompt_tokens_sent=200)
    assert out["prefix_cache_hits"] == 64 + 128 and out["prefix_cache_queries"] == 400
    assert out["prefix_cache_hit_rate"] == pytest.approx(192 / 400)
    assert out["prefill_hit_rate"] == pytest.approx(1 - 136 / 200) and out["kv_bytes_transferred"] == 4096
    assert "kv_blocks_pulled" not in out  # no instance exports it
    restarted = delta({"p": p1}, {"p": p0})["p"]  # lower after than before: counted from zero
    assert restarted["prompt_tokens_computed"] == 100
    first_read = delta({"d": {}}, {"d": d1})["d"]  # a histogram's first observation came during the run
    assert first_read["kv_bytes_transferred"] == 5096
    json.dumps(out)
