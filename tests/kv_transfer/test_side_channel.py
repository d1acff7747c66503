"""The ZMQ side channel with real sockets: HMAC refusal, timeouts, concurrent exchanges."""

from __future__ import annotations

import queue
import threading
import time

from pdserve.kv_transfer.messages import ErrorReply, Heartbeat, HeartbeatAck, LeaseAnswer
from pdserve.kv_transfer.side_channel import SideChannelClient, SideChannelServer


def _ask(client, port, timeout=2.0):
    out = queue.Queue()
    client.send("127.0.0.1", port, Heartbeat("c", 1, ["r"]), timeout, out.put)
    return out.get(timeout=timeout + 2)


def test_hmac_required_when_a_secret_is_set():
    served = []
    server = SideChannelServer("127.0.0.1", 0, b"s3cret",
                               lambda m: served.append(m) or HeartbeatAck([LeaseAnswer.HELD], 30.0, 60.0))
    good, bad, none = SideChannelClient(b"s3cret"), SideChannelClient(b"wrong"), SideChannelClient(None)
    try:
        assert isinstance(_ask(good, server.port), HeartbeatAck)
        for c in (bad, none):
            reply = _ask(c, server.port)
            if isinstance(reply, ErrorReply):
                assert "unauthenticated" in reply.error
            else:  # a client with a (wrong) secret cannot verify the refusal's HMAC
                assert "HMAC" in str(reply)
        assert len(served) == 1 and server.num_refused == 2
    finally:
        for c in (good, bad, none):
            c.close()
        server.close()


def test_timeout_and_concurrency():
    gate = threading.Event()
    slow = SideChannelServer("127.0.0.1", 0, None, lambda m: gate.wait(5) and HeartbeatAck([LeaseAnswer.HELD], 1.0, 2.0))
    fast = SideChannelServer("127.0.0.1", 0, None, lambda m: HeartbeatAck([LeaseAnswer.GONE], 1.0, 2.0))
    client = SideChannelClient(None)
    try:
        results = queue.Queue()
        start = time.monotonic()
        client.send("127.0.0.1", slow.port, Heartbeat("c", 1, ["r"]), 0.5, lambda r: results.put(("slow", r)))
        client.send("127.0.0.1", fast.port, Heartbeat("c", 1, ["r"]), 5, lambda r: results.put(("fast", r)))
        first = results.get(timeout=5)
        assert first[0] == "fast" and isinstance(first[1], HeartbeatAck)  # not stuck behind "slow"
        second = results.get(timeout=5)
        assert second[0] == "slow" and isinstance(second[1], TimeoutError)
        assert time.monotonic() - start < 2
    finally:
        gate.set()
        client.close()
        slow.close()
        fast.close()


def test_a_secret_rotates_on_the_side_channel():
    """Each side signs with its current secret and accepts its previous one too, so instances
    rolled to a new secret and instances not yet rolled keep talking (docs/security.md)."""
    server = SideChannelServer("127.0.0.1", 0, b"new", lambda m: HeartbeatAck([LeaseAnswer.HELD], 30.0, 60.0),
                               previous=b"old")
    not_rolled = SideChannelClient(b"old", previous=b"new")  # phase 1: accepts new, signs old
    rolled = SideChannelClient(b"new", previous=b"old")
    stranger = SideChannelClient(b"other", previous=b"old2")
    try:
        assert isinstance(_ask(not_rolled, server.port), HeartbeatAck)
        assert isinstance(_ask(rolled, server.port), HeartbeatAck)
        assert not isinstance(_ask(stranger, server.port), HeartbeatAck)
        assert server.num_refused == 1
    finally:
        for c in (not_rolled, rolled, stranger):
            c.close()
        server.close()
