"""The client's sessions against a fake OpenAI server (httpx's MockTransport): a multi-turn prompt is
the previous prompt, the answer's token ids and the new tokens; turns wait for the answer and the
think time; sessions overlap within --max-concurrency; trace requests leave at their timestamps."""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path

import httpx
import pytest

from pdserve.bench.client import run
from pdserve.bench.datasets import BenchRequest, DatasetArgs, MultiTurnArgs, TraceArgs, make
from pdserve.bench.lru_bound import LRUBound

TINY_TRACE = Path(__file__).parent / "data" / "tiny_trace.jsonl"


class FakeServer:
    """Streams `max_tokens` tokens with ids of its own, after `delay_s` (a 500 for a prompt of
    `fail_len` tokens); records what it was sent."""

    def __init__(self, delay_s: float = 0.02, token_ids: bool = True, fail_len: int | None = None):
        self.delay_s, self.token_ids, self.fail_len = delay_s, token_ids, fail_len
        self.calls: list[dict] = []  # body, sent_at, done_at
        self.in_flight = self.max_in_flight = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        call = {"body": body, "sent_at": time.perf_counter()}
        self.calls.append(call)
        if len(body["prompt"]) == self.fail_len:
            return httpx.Response(500, json={"error": {"message": "boom"}})
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(self.delay_s)
        self.in_flight -= 1
        answer = [5000 + 10 * len(self.calls) + k for k in range(body["max_tokens"])]
        lines = []
        for t in answer:
            choice = {"index": 0, "text": "x"} | ({"token_ids": [t]} if self.token_ids else {})
            lines.append("data: " + json.dumps({"choices": [choice]}))
        lines.append("data: " + json.dumps({"choices": [], "usage": {"completion_tokens": len(answer)}}))
        lines.append("data: [DONE]")
        call["answer"], call["done_at"] = answer, time.perf_counter()
        return httpx.Response(200, content="\n\n".join(lines).encode() + b"\n\n",
                              headers={"content-type": "text/event-stream"})


def go(server: FakeServer, requests, **kw):
    return asyncio.run(run("http://fake", "/v1/completions", requests, "m", progress=False,
                           transport=httpx.MockTransport(server), **kw))


def sessions_of(n: int, turns: int, think_s: float) -> list[BenchRequest]:
    return make(DatasetArgs(name="multi-turn", seed=4, multi_turn=MultiTurnArgs(
        num_sessions=n, num_turns=turns, system_len=20, user_len=6, answer_len=3, think_time_s=think_s,
        think_time_dist="fixed")))


def test_each_turn_carries_the_history_and_waits_for_the_answer_and_think_time():
    reqs = sessions_of(2, 3, think_s=0.1)
    server = FakeServer()
    bound = LRUBound(None, block_size=4)
    results, duration = go(server, reqs, bounds=[bound])
    assert all(r.success for r in results) and [r.turn for r in results] == [0, 1, 2] * 2
    by_session: dict[str, list[dict]] = {}
    for call in server.calls:
        first = call["body"]["prompt"][:20]
        by_session.setdefault(tuple(first), []).append(call)
    assert len(by_session) == 2
    for s, calls in enumerate(by_session.values()):
        turns = reqs[3 * s:3 * s + 3]
        assert calls[0]["body"]["prompt"] == turns[0].prompt and calls[0]["body"]["return_token_ids"] is True
        for k in (1, 2):
            prev, call = calls[k - 1], calls[k]
            assert call["body"]["prompt"] == prev["body"]["prompt"] + prev["answer"] + turns[k].prompt
            assert len(call["body"]["prompt"]) == turns[k].prompt_len
            assert call["sent_at"] - prev["done_at"] >= 0.1  # the answer, then the think time
    assert [r.prompt_len for r in results] == [r.prompt_len for r in reqs]
    # the two sessions overlap (started at once), each turn after its own think time
    assert server.max_in_flight == 2 and duration < 3 * (0.02 + 0.1) + 0.5
    # the bound saw each prompt and each answer: from turn 2 the history (prompt and answer) is reused
    assert bound.num_queried_tokens == sum(r.prompt_len for r in reqs)
    assert bound.num_hit_tokens == sum((r.prompt_len - 7) // 4 * 4 for r in reqs if r.with_history)


def test_max_concurrency_bounds_requests_in_flight():
    server = FakeServer(delay_s=0.05)
    results, _ = go(server, sessions_of(4, 2, think_s=0.0), max_concurrency=1)
    assert all(r.success for r in results) and server.max_in_flight == 1


def test_sessions_start_at_the_request_rate():
    server = FakeServer(delay_s=0.0)
    go(server, sessions_of(40, 1, think_s=0.0), request_rate=100.0, seed=3)
    starts = sorted(c["sent_at"] for c in server.calls)
    assert 0.25 < starts[-1] - starts[0] < 0.8  # 39 gaps of 10 ms on average


def test_a_failed_turn_ends_its_session_not_the_others():
    reqs = sessions_of(1, 3, think_s=0.0) + [BenchRequest([7, 8, 9], 3, 2)]
    assert reqs[1].prompt_len == 35
    results, _ = go(FakeServer(fail_len=35), reqs)
    assert [r.success for r in results] == [True, False, False, True]
    assert results[1].error.startswith("500") and "not sent: turn 1" in results[2].error
    no_ids, _ = go(FakeServer(token_ids=False), sessions_of(1, 2, think_s=0.0))
    assert not no_ids[0].success and "return_token_ids" in no_ids[0].error and not no_ids[1].success


def test_chat_cannot_carry_token_histories():
    with pytest.raises(ValueError, match="/v1/completions"):
        asyncio.run(run("http://fake", "/v1/chat/completions", sessions_of(1, 2, 0.0), progress=False))


def test_trace_requests_leave_at_their_scaled_timestamps():
    reqs = make(DatasetArgs(name="trace", path=str(TINY_TRACE), num_prompts=None,
                            trace=TraceArgs(block_tokens=16, time_scale=0.5)))
    server = FakeServer(delay_s=0.01)
    results, duration = go(server, reqs, request_rate=math.inf)
    assert all(r.success for r in results) and duration >= 0.35
    sent = {tuple(c["body"]["prompt"]): c["sent_at"] for c in server.calls}
    t = [sent[tuple(r.prompt.ids())] for r in reqs]
    offsets = [x - t[0] for x in t]
    for got, want in zip(offsets, [0, 0.05, 0.1, 0.15, 0.25, 0.35]):
        assert want <= got + 0.005 and got < want + 0.1, offsets
    assert "return_token_ids" not in server.calls[0]["body"]  # no history to build
    assert [r.session_id for r in results] == [None, None, "a", "a", None, None]
