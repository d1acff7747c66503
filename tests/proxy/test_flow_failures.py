"""The proxy's flow when instances fail or answer oddly, on fake instances (no processes): a producer's
error is not "busy", a decode leg is never sent twice, a proxy without producers still answers one
token, chat streams count their first token, instances leaving the pool keep their clients until
nothing holds them, and `auto` does not ask a down instance on every request."""

from __future__ import annotations

import asyncio
import json
import time

from pdserve.health import Health, Load
from pdserve.proxy.decision import DisaggPolicy
from pdserve.proxy.flow import PDFlow
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.router import Router, retire
from pdserve.proxy.upstream import Reply, UpstreamError

KV = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_block_ids": [0]}
OK = json.dumps({"choices": [{"text": "a", "finish_reason": None}], "kv_transfer_params": KV}).encode()


class Fake:
    """An instance: `answers` is what post_json returns (a Reply, or an exception to raise), in turn."""

    def __init__(self, url: str, *answers, owner: str | None = "pdserve"):
        self.url = url
        self.answers = list(answers) or [Reply(200, OK)]
        self.posts: list[tuple[str, dict]] = []
        self.owner_calls = 0
        self._owner = owner
        self.closed = False
        self.in_use = 0

    def hold(self) -> None:
        self.in_use += 1

    def unhold(self) -> None:
        self.in_use -= 1

    async def post_json(self, path, body, headers):
        assert not self.closed, f"{self.url}: used after close"
        self.posts.append((path, body))
        answer = self.answers[min(len(self.posts) - 1, len(self.answers) - 1)]
        if isinstance(answer, Exception):
            raise answer
        if callable(answer):
            return await answer()
        return answer

    async def owner(self):
        self.owner_calls += 1
        await asyncio.sleep(0.05)
        return self._owner

    async def close(self) -> None:
        self.closed = True


async def _never_gone() -> bool:
    return False


def _run(coro, timeout_s: float = 10.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def _flow(prefill, decode, **kw) -> PDFlow:
    kw.setdefault("protocol", "pdserve")
    return PDFlow(Router(prefill, decode), ProxyMetrics(), **kw)


def _body(**kw) -> bytes:
    return json.dumps({"prompt": [1, 2, 3], "max_tokens": 4, **kw}).encode()


def test_a_producer_error_is_passed_on_at_once_not_taken_for_busy():
    error = Reply(500, json.dumps({"error": {"message": "boom", "type": "InternalServerError",
                                             "code": 500, "param": None}}).encode())
    p0, p1, d = Fake("http://p0", error), Fake("http://p1", error), Fake("http://d")

    async def main():
        flow = _flow([p0, p1], [d], max_wait_s=30)
        start = time.monotonic()
        r = await flow.handle(_body(), "/v1/completions", "r", _never_gone)
        return r, time.monotonic() - start
    r, took = _run(main())
    assert r.status_code == 500 and b"boom" in r.body
    assert took < 2 and len(p0.posts) == 1 and len(p1.posts) == 1  # each producer asked once, no waiting
    assert not d.posts


def test_a_busy_producer_is_still_waited_for():
    busy = Reply(503, b'{"error": {"message": "busy"}}')
    p = Fake("http://p", busy, busy, Reply(200, OK))
    d = Fake("http://d", Reply(200, b'{"choices": [{"text": "abc", "finish_reason": "length"}]}'))

    async def main():
        return await _flow([p], [d], max_wait_s=5).handle(_body(), "/v1/completions", "r", _never_gone)
    r = _run(main())
    assert r.status_code == 200 and len(p.posts) == 3 and len(d.posts) == 1


def test_one_token_without_producers_is_answered_by_decode():
    d = Fake("http://d", Reply(200, b'{"choices": [{"text": "a", "finish_reason": "length"}]}'))

    async def main():
        return await _flow([], [d], max_wait_s=30).handle(_body(max_tokens=1), "/v1/completions", "r",
                                                          _never_gone)
    r = _run(main(), timeout_s=5)
    assert r.status_code == 200 and len(d.posts) == 1
    assert "kv_transfer_params" not in d.posts[0][1]


def test_a_decode_leg_that_was_taken_is_never_sent_elsewhere():
    taken = UpstreamError("http://d0/v1/completions: ServerDisconnectedError", sent=True)
    p = Fake("http://p")
    d0, d1 = Fake("http://d0", taken), Fake("http://d1")
    released = []

    async def release():
        released.append(True)
        return Reply(200, b'{"released": true}')

    async def main():
        flow = _flow([p], [d0, d1])
        flow.router.decode.states[1].outstanding = 5  # d0 is tried first
        r = await flow.handle(_body(), "/v1/completions", "r", _never_gone)
        await asyncio.sleep(0.05)
        return flow, r
    p.answers = [Reply(200, OK), release]
    flow, r = _run(main())
    assert r.status_code == 502 and b"http://d0" in r.body
    assert not d1.posts  # the params are single-use: never a second decode
    assert released == [True]  # the producer's blocks are handed back (decode may never have read them)


def test_a_decode_read_timeout_does_not_mark_the_instance_down():
    timed_out = UpstreamError("http://d0/v1/completions: TimeoutError", sent=True, timeout=True)
    p, d0, d1 = Fake("http://p"), Fake("http://d0", timed_out), Fake("http://d1")

    async def main():
        flow = _flow([p], [d0, d1])
        flow.router.decode.states[1].outstanding = 5
        return flow, await flow.handle(_body(), "/v1/completions", "r", _never_gone)
    flow, r = _run(main())
    assert r.status_code == 502 and b"http://d0" in r.body and not d1.posts
    assert all(s.healthy for s in flow.router.decode.states)


def test_a_decode_that_cannot_be_reached_is_skipped():
    refused = UpstreamError("http://d0/v1/completions: ClientConnectorError", sent=False)
    d0 = Fake("http://d0", refused)
    d1 = Fake("http://d1", Reply(200, b'{"choices": [{"text": "abc", "finish_reason": "length"}]}'))

    async def main():
        flow = _flow([Fake("http://p")], [d0, d1])
        flow.router.decode.states[1].outstanding = 5
        return flow, await flow.handle(_body(), "/v1/completions", "r", _never_gone)
    flow, r = _run(main())
    assert r.status_code == 200 and len(d1.posts) == 1
    assert not flow.router.decode.states[0].healthy


def _chat(content) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 4}).encode()


def test_chat_content_parts_count_toward_the_prompt_length():
    p, d = Fake("http://p"), Fake("http://d", Reply(200, b'{"choices": []}'))

    async def main():
        flow = _flow([p], [d], policy=DisaggPolicy(local_max_tokens=64))
        parts = [{"type": "text", "text": "word " * 2000}, {"type": "text", "text": "more " * 2000}]
        long = await flow.handle(_chat(parts), "/v1/chat/completions", "a", _never_gone)
        short = await flow.handle(_chat([{"type": "text", "text": "hi"}]), "/v1/chat/completions", "b",
                                  _never_gone)
        return long.headers["X-PD-Decision"], short.headers["X-PD-Decision"]
    assert _run(main()) == ("remote", "local")


class ChatStream:
    """A pdserve chat stream: the role first (before the prompt is prefilled), then every chunk with
    `"role": null`, as the server serialises it."""

    def __init__(self, gate: asyncio.Event, done: asyncio.Event):
        self.status_code = 200
        self.gate, self.done = gate, done

    @staticmethod
    def event(delta: dict, finish=None) -> bytes:
        return b"data: " + json.dumps({"object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": delta, "finish_reason": finish}]}).encode() + b"\n\n"

    async def chunks(self):
        yield self.event({"role": "assistant", "content": ""})
        await self.gate.wait()
        yield self.event({"role": None, "content": "a"})
        await self.done.wait()
        yield self.event({"role": None, "content": ""}, "length")
        yield b"data: [DONE]\n\n"

    async def close(self) -> None:
        pass


def test_a_chat_stream_stops_counting_as_a_prefill_at_its_first_token():
    async def main():
        gate, done = asyncio.Event(), asyncio.Event()
        d = Fake("http://d")

        async def open_stream(path, body, headers):
            return ChatStream(gate, done)
        d.open_stream = open_stream
        flow = _flow([Fake("http://p")], [d], policy=DisaggPolicy(local_max_tokens=256))
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()
        r = await flow.handle(body, "/v1/chat/completions", "r", _never_gone)
        assert r.headers["X-PD-Decision"] == "local"
        chunks = []

        async def drain():
            async for c in r.body_iterator:
                chunks.append(c)
        task = asyncio.ensure_future(drain())
        state = flow.router.decode.states[0]
        await asyncio.sleep(0.02)
        assert state.prefilling == 1 and len(chunks) == 1  # only the role came
        assert flow.metrics.ttft._sum.get() == 0  # ... which is not the first token
        gate.set()
        await asyncio.sleep(0.02)
        assert state.prefilling == 0 and flow.metrics.ttft._sum.get() > 0
        done.set()
        await task
        assert state.outstanding == 0
    _run(main())


def test_a_non_streaming_local_prefill_counts_until_the_next_probe_reports_it():
    async def main():
        gate = asyncio.Event()

        async def answer():
            await gate.wait()
            return Reply(200, b'{"choices": [{"text": "a", "finish_reason": "length"}]}')
        d = Fake("http://d", answer)

        async def health():
            return True, Health(load=Load(num_waiting=0))
        d.health = health
        flow = _flow([Fake("http://p")], [d], policy=DisaggPolicy(local_max_tokens=256))
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
        task = asyncio.ensure_future(flow.handle(body, "/v1/chat/completions", "r", _never_gone))
        await asyncio.sleep(0.02)
        assert flow.router.decode.least_prefilling() == 1  # sent, not yet seen by a probe
        await flow.router.decode.probe()  # decode says nothing waits: its prefill is done
        assert flow.router.decode.least_prefilling() == 0
        gate.set()
        assert (await task).status_code == 200
        assert flow.router.decode.least_prefilling() == 0
    _run(main())


def test_an_instance_leaving_the_pool_keeps_its_client_until_nothing_holds_it():
    async def main():
        gate = asyncio.Event()
        released = []

        async def prefill_answer():
            return Reply(200, OK)

        async def release():
            released.append(True)
            return Reply(200, b'{"released": true}')
        p = Fake("http://p", prefill_answer, release)

        async def decode_refuses():
            await gate.wait()
            return Reply(503, b'{"error": {"message": "busy"}}')
        d = Fake("http://d", decode_refuses)
        flow = _flow([p], [d])
        task = asyncio.ensure_future(flow.handle(_body(), "/v1/completions", "r", _never_gone))
        await asyncio.sleep(0.02)  # the producer answered; the decode leg waits
        closing = [asyncio.ensure_future(retire(s, poll_s=0.01))
                   for s in flow.router.prefill.set_members([], lambda url: None)]
        await asyncio.sleep(0.05)
        assert not p.closed  # the lease it handed out may still have to go back
        gate.set()
        r = await task
        await asyncio.gather(*closing)
        return r, released, p.closed
    r, released, closed = _run(main())
    assert r.status_code == 503 and released == [True] and closed


def test_auto_protocol_asks_a_healthy_instance_and_not_on_every_request():
    async def main():
        down, up = Fake("http://p0", owner=None), Fake("http://p1", owner="vllm")
        d = Fake("http://d", Reply(200, b'{"choices": [{"text": "a", "finish_reason": "length"}]}'))
        flow = PDFlow(Router([down, up], [d]), ProxyMetrics(), protocol="auto")
        flow.router.prefill.mark_down(flow.router.prefill.states[0], "refused")
        protocols = await asyncio.gather(*(flow.upstream_protocol() for _ in range(5)))
        return down, up, protocols
    down, up, protocols = _run(main())
    assert down.owner_calls == 0 and up.owner_calls == 1  # one question, to an instance that is up
    assert protocols == ["vllm"] * 5


def test_auto_protocol_does_not_ask_again_right_after_no_answer():
    async def main():
        silent = Fake("http://p0", owner=None)
        d = Fake("http://d", Reply(200, b'{"choices": [{"text": "a", "finish_reason": "length"}]}'))
        flow = PDFlow(Router([silent], [d]), ProxyMetrics(), protocol="auto")
        for _ in range(5):
            assert await flow.upstream_protocol() == "pdserve"  # the default until one answers
        return silent
    assert _run(main()).owner_calls == 1
