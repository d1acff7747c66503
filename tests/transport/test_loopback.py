"""The loopback fabric and network behave as tests rely on: memory checked like NIXL checks it,
notifications delivered to the named peer, faults doing what they say."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.transport.base import TransferError, XferState
from pdserve.transport.loopback import LoopbackFabric, LoopbackNetwork


def descs(buf: np.ndarray, offset: int, n: int) -> np.ndarray:
    return np.array([[buf.ctypes.data + offset, n, 0]], dtype=np.uint64)


@pytest.fixture
def two():
    f = LoopbackFabric()
    a, b = f.agent("a"), f.agent("b")
    src, dst = np.arange(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
    a.register(dst.ctypes.data, dst.nbytes)
    b.register(src.ctypes.data, src.nbytes)
    assert a.add_peer(b.metadata()) == "b" and b.add_peer(a.metadata()) == "a"
    return f, a, b, src, dst


def test_a_read_copies_and_notifies(two):
    f, a, b, src, dst = two
    h = a.read("b", descs(dst, 0, 16), descs(src, 8, 16), b"done")
    assert a.state(h) == XferState.DONE and dst[:16].tolist() == list(range(8, 24))
    assert b.notifications() == {"a": [b"done"]} and b.notifications() == {}


def test_memory_outside_the_registered_regions_is_refused(two):
    f, a, b, src, dst = two
    with pytest.raises(TransferError):
        a.read("b", descs(dst, 0, 16), descs(src, 60, 16), b"")
    with pytest.raises(TransferError):
        a.read("nobody", descs(dst, 0, 16), descs(src, 0, 16), b"")


def test_faults(two):
    f, a, b, src, dst = two
    f.hang_reads = True
    h = a.read("b", descs(dst, 0, 4), descs(src, 0, 4), b"")
    assert a.state(h) == XferState.PROC and dst[:4].sum() == 0
    a.release(h)
    assert f.land_hung() == 1 and dst[:4].tolist() == [0, 1, 2, 3]  # lands after the release
    f.hang_reads = False
    f.lose("b")
    with pytest.raises(TransferError):
        a.read("b", descs(dst, 0, 4), descs(src, 0, 4), b"")
    with pytest.raises(TransferError):
        a.notify("b", b"x")


def test_the_network_answers_on_pump_and_times_out_silence():
    now = [0.0]
    net = LoopbackNetwork(lambda: now[0])
    server = net.serve("h", 0, lambda m: m * 2)
    got = []
    client = net.client()
    client.send("h", server.port, 21, 1.0, got.append)
    client.send("h", 1, 1, 1.0, got.append)
    assert net.pump() == 1 and got == [42]
    now[0] = 1.0
    assert net.pump() == 1 and isinstance(got[-1], TimeoutError)
    server.close()
    client.send("h", server.port, 1, 0.5, got.append)
    now[0] = 2.0
    net.pump()
    assert isinstance(got[-1], TimeoutError)
