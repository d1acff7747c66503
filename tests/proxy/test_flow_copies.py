"""One kept copy per disaggregated prompt, through the proxy's flow on fake instances: with kv-aware
routing the proxy tells the producer or the decode instance that its copy is the spare
(`kv_transfer_params.spare_copy`), the same one for every turn of a conversation, never both, and
only with `--kv-copies one` (the default)."""

from __future__ import annotations

import asyncio
import json

from test_flow_decision import FakeInstance, HeldIndex, Ids, _drain, _never_gone
from test_placement import FakeUpstream

from pdserve.health import PrefixCacheInfo
from pdserve.proxy.copies import Copies
from pdserve.proxy.flow import PDFlow
from pdserve.proxy.flow import _holders as flow_holders
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.placement import Placement
from pdserve.proxy.router import Router, UpstreamState


def _run(copies: Copies | None) -> list[tuple[bool, bool]]:
    """Two conversations of three turns each; per request, whether the producer's and the decode
    instance's params said spare_copy."""
    async def main():
        prefill, decode = FakeInstance("http://p"), FakeInstance("http://d")
        decode.gate.set()
        decode.done.set()
        router = Router([prefill], [decode], policy="kv-aware", index=HeldIndex({}), copies=copies)
        for s in router.prefill.states + router.decode.states:
            s.prefix_cache = PrefixCacheInfo(model_key="m", block_size=16)
        flow = PDFlow(router, ProxyMetrics(), protocol="pdserve", prompts=Ids())
        out = []
        for turn in range(3):
            for conversation in (1, 2):
                prompt = [conversation] * 16 * (turn + 2)  # each turn extends the last by a block
                body = {"prompt": prompt, "max_tokens": 8, "stream": True}
                response = await flow.handle(json.dumps(body).encode(), "/v1/completions", "r", _never_gone)
                assert response.headers["X-PD-Decision"] == "remote"
                await _drain(response.body_iterator)
                out.append((bool(prefill.bodies[-1]["kv_transfer_params"].get("spare_copy")),
                            bool(decode.bodies[-1]["kv_transfer_params"].get("spare_copy"))))
        return out
    return asyncio.run(asyncio.wait_for(main(), 10))


def test_each_conversation_keeps_one_copy_in_one_pool_turn_after_turn():
    said = _run(Copies())
    assert all(p != d for p, d in said)  # exactly one of the two copies is the spare
    first, second = said[0::2], said[1::2]
    assert len(set(first)) == 1 and len(set(second)) == 1  # a conversation keeps its pool
    assert first[0] != second[0]  # new conversations alternate between the pools


def test_both_copies_are_kept_alike_when_asked():
    assert _run(None) == [(False, False)] * 6


def test_the_placement_log_says_where_each_request_went():
    """`--placement-log`: per request, the first-choice producer and decode instance, the decision,
    the spare copy, what each instance held, the predicted times and the rates used, as the proxy saw
    them when it placed it."""
    records = []

    async def main():
        prefill, decode = FakeInstance("http://p"), FakeInstance("http://d")
        decode.gate.set()
        decode.done.set()
        router = Router([prefill], [decode], policy="kv-aware", index=HeldIndex({"http://p": 1}), copies=Copies())
        for s in router.prefill.states + router.decode.states:
            s.prefix_cache = PrefixCacheInfo(model_key="m", block_size=16)
        flow = PDFlow(router, ProxyMetrics(), protocol="pdserve", prompts=Ids(), record=records.append)
        body = {"prompt": [1] * 40, "max_tokens": 8, "stream": True}
        response = await flow.handle(json.dumps(body).encode(), "/v1/completions", "r1", _never_gone)
        await _drain(response.body_iterator)
        return response.headers["X-PD-Decision"], prefill.bodies[-1]["kv_transfer_params"].get("spare_copy")
    decision, producer_spare = asyncio.run(asyncio.wait_for(main(), 10))
    (r,) = records
    assert r["request_id"] == "r1" and r["prompt_tokens"] == 40 and r["decision"] == decision == "remote"
    assert r["prefill"] == "http://p" and r["decode"] == "http://d"
    assert r["spare_copy"] == ("prefill" if producer_spare else "decode")
    assert r["held"] == {"http://p": 16, "http://d": 0}  # tokens: the producer caches the first block
    # what the decision was made from: no instance measured yet, so the default rate everywhere
    assert r["rates"] == {"http://p": 1000, "http://d": 1000} and r["remote_s"] > 0
    # d holds nothing: all 40 tokens to compute (p's 16 are too few to pull)
    assert r["local_s"] is None and r["stall_s"] == {"http://d": 0.04}


def test_the_placement_log_file_gets_a_whole_json_line_per_placement(tmp_path):
    from pdserve.proxy.app import PlacementLog
    path = tmp_path / "placements.jsonl"
    record = PlacementLog(str(path))
    record({"request_id": "a", "held": {"http://p": 16}})
    record({"request_id": "b", "held": {}})
    lines = path.read_text().splitlines()  # line-buffered: readable while the proxy runs
    assert [json.loads(line)["request_id"] for line in lines] == ["a", "b"]
    record.close()
    assert record.out.closed


def test_the_proxy_closes_its_placement_log_when_it_stops(tmp_path):
    from fastapi.testclient import TestClient

    from pdserve.config import ProxyConfig
    from pdserve.proxy.app import create_app
    path = tmp_path / "placements.jsonl"
    before = _open_files_at(path)
    with TestClient(create_app(ProxyConfig((), ("http://127.0.0.1:9",), placement_log=str(path)))):
        assert _open_files_at(path) == before + 1
    assert _open_files_at(path) == before


def _open_files_at(path) -> int:
    import os
    fds = os.listdir("/proc/self/fd")
    return sum(1 for fd in fds if os.path.realpath(f"/proc/self/fd/{fd}") == str(path))


def _state(url: str) -> UpstreamState:
    return UpstreamState(FakeUpstream(url), kv_holder={"engine_id": url})


def test_a_holder_that_does_not_keep_the_prompt_lends_it_as_its_spare_copy():
    """With one copy kept, the instances the prefilling one claims from are told that what they lend
    becomes their spare copy, unless they keep this prompt themselves: a history that moves to
    another instance is not kept twice. With both copies kept, nobody is told."""
    p1, p2, d1, d2 = (_state(u) for u in ("p1", "p2", "d1", "d2"))
    plan = Placement(decode=[d2, d1], prefill=[p2, p1], holders=[d1, p1])

    def told(decision, spare, one_copy=True):
        return {h["engine_id"] for h in flow_holders(plan, decision, spare, one_copy) if h.get("spare")}
    assert told("remote", "prefill") == {"d1", "p1"}  # decode d2 keeps it: d1's history moved there
    assert told("remote", "decode") == {"d1", "p1"}  # producer p2 keeps it
    assert told("local", None) == {"d1", "p1"}  # d2 prefills and keeps it
    assert told("remote", "prefill", one_copy=False) == told("remote", None) == set()
    kept_by_d1 = Placement(decode=[d1, d2], prefill=[p2, p1], holders=[d1, p1])
    assert {h["engine_id"] for h in flow_holders(kept_by_d1, "remote", "prefill", True) if h.get("spare")} \
        == {"p1"}  # the turn stays on d1, whose copy the producer reads: d1 keeps it
    assert [h["engine_id"] for h in flow_holders(plan, "remote", None, True)] == ["d1", "p1"]
