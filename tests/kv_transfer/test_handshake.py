"""Both halves of the handshake: what the producer answers, and the order in which the consumer
checks a reply (nothing is decoded before the fingerprint and engine id are right)."""

from __future__ import annotations

import msgspec
import pytest

from pdserve.kv_transfer.handshake import (HandshakeError, HandshakeReplied, Peer, PeerState, PeerTable,
                                           accept_reply, answer_handshake, ranks_to_ask)
from pdserve.kv_transfer.messages import (HANDSHAKE_VERSION, Fingerprint, HandshakePayload, HandshakeReply,
                                          HandshakeRequest, RankAgent)
from pdserve.transport.loopback import LoopbackNetwork

OURS = Fingerprint("m", "float32", 2, 4, 8, 16)


def agents(tp: int) -> list[RankAgent]:
    return [RankAgent(r, f"P/rank{r}", b"meta", [0, 1], 8, 4 // tp, 64, 16) for r in range(tp)]


def peer(tp=2, asked=(0, 1)) -> Peer:
    return Peer("P", "h", 1, tp, list(asked))


def reply_for(req: HandshakeRequest, tp: int = 2, fingerprint=OURS) -> HandshakeReply:
    return answer_handshake(req, "P", fingerprint, agents(tp))


def test_ranks_to_ask_are_only_the_ones_read_from():
    assert ranks_to_ask(4, 2, 4) == [0, 1, 2, 3]
    assert ranks_to_ask(2, 4, 4) == [0, 1]
    assert ranks_to_ask(4, 1, 1) == [0]  # every producer rank holds the one head: ask one


def test_the_producer_answers_version_engine_and_ranks():
    assert "version" in reply_for(HandshakeRequest(99, "P", [0])).error
    assert "not Q" in reply_for(HandshakeRequest(HANDSHAKE_VERSION, "Q", [0])).error
    assert "do not exist" in reply_for(HandshakeRequest(HANDSHAKE_VERSION, "P", [0, 5])).error
    ok = reply_for(HandshakeRequest(HANDSHAKE_VERSION, "P", [1]))
    payload = msgspec.msgpack.decode(ok.payload, type=HandshakePayload)
    assert payload.producer_tp_size == 2 and [r.rank for r in payload.ranks] == [1]


def test_a_good_reply_gives_the_agents_asked_for():
    got = accept_reply(reply_for(HandshakeRequest(HANDSHAKE_VERSION, "P", [0, 1])), peer(), OURS, 5)
    assert got.producer_tp_size == 2 and [r.rank for r in got.ranks] == [0, 1]


@pytest.mark.parametrize("reply, words", [
    (TimeoutError("no answer"), "unreachable (handshake timed out"),
    (ConnectionError("refused"), "unreachable (handshake failed"),
    (HandshakeReply(HANDSHAKE_VERSION + 1, "P", OURS), "handshake version"),
    (HandshakeReply(HANDSHAKE_VERSION, "P", OURS, error="this is engine X"), "this is engine X"),
    (HandshakeReply(HANDSHAKE_VERSION, "P", None), "no compatibility fingerprint"),
    (HandshakeReply(HANDSHAKE_VERSION, "P", Fingerprint("m", "bfloat16", 2, 4, 8, 16), payload=b"\xc1"),
     "incompatible producer: dtype: ours='float32' theirs='bfloat16'"),
    (HandshakeReply(HANDSHAKE_VERSION, "Q", OURS, payload=b"\xc1"), "reached engine Q"),
    (HandshakeReply(HANDSHAKE_VERSION, "P", OURS, payload=b"\xc1"), "undecodable"),
])
def test_each_bad_reply_says_what_is_wrong(reply, words):
    with pytest.raises(HandshakeError) as e:
        accept_reply(reply, peer(), OURS, 5)
    assert words in str(e.value)


def test_a_reply_with_ranks_not_asked_for_is_refused():
    sneaky = reply_for(HandshakeRequest(HANDSHAKE_VERSION, "P", [0, 1]))
    with pytest.raises(HandshakeError, match="not the ranks asked for"):
        accept_reply(sneaky, peer(asked=[1]), OURS, 5)


def table() -> tuple[PeerTable, list, LoopbackNetwork]:
    net = LoopbackNetwork()
    events = []
    return PeerTable(net.client(), OURS, 1, 4, 5.0, events.append), events, net


def test_the_peer_table_verifies_once_and_evicts_a_replaced_engine():
    t, events, net = table()
    net.serve("h", 1, lambda m: reply_for(m))
    t.handshake("P", "h", 1, 2)
    net.pump()
    result = t.accept(events.pop())
    assert result.ready and t.get("P").state == PeerState.READY and t.round_trips == 1
    assert t.check_tp("P", 2) is None and "tp_size=1" in t.check_tp("P", 1)
    assert [p.engine_id for p in t.to_workers()] == ["P"] and t.to_workers() == []
    # a new engine at the same address: the old one is gone, and the ranks drop its agents
    net.servers[("h", 1)] = lambda m: answer_handshake(m, "P2", OURS, agents(2))
    t.handshake("P2", "h", 1, 2)
    net.pump()
    result = t.accept(events.pop())
    assert result.replaced == ("P",) and t.get("P") is None and t.take_evicted() == ["P"]


def test_a_reply_with_another_tp_size_evicts_and_reports_it():
    t, events, net = table()
    net.serve("h", 1, lambda m: reply_for(m, tp=4))
    t.handshake("P", "h", 1, 2)  # the request said 2; the producer has 4
    net.pump()
    result = t.accept(events.pop())
    assert not result.ready and result.producer_tp_size == 4 and t.get("P") is None


def test_a_failed_handshake_is_counted_and_forgotten():
    t, events, net = table()
    t.handshake("P", "nowhere", 9, 1)
    net.clock = lambda: 1e12  # the timeout has long passed
    net.pump()
    result = t.accept(events.pop())
    assert "unreachable" in result.error and t.failures == 1 and t.get("P") is None
    assert t.accept(HandshakeReplied("P", 0.0, None)) is None  # nobody waits any more
