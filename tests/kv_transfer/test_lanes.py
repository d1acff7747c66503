"""How a READ's descriptors are shared among copy lanes."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.kv_transfer.lanes import lane_shares

MiB = 1 << 20


@pytest.mark.parametrize("sizes, lanes, expected", [
    ([MiB] * 16, 2, [(0, 8), (8, 16)]),
    ([MiB] * 16, 3, [(0, 6), (6, 11), (11, 16)]),
    ([MiB] * 16, 1, [(0, 16)]),
    ([64 << 10] * 8, 2, [(0, 8)]),  # 512 KiB in all: not worth a handoff
    ([4 * MiB], 2, [(0, 1)]),  # one descriptor is never split
    ([10 * MiB, 1, 1], 2, [(0, 1), (1, 3)]),
    ([1, 1, 10 * MiB], 2, [(0, 3)]),  # the only cut would leave nothing for the second lane
    ([MiB] * 3, 8, [(0, 1), (1, 2), (2, 3)]),  # never more shares than descriptors
])
def test_shares(sizes, lanes, expected):
    shares = lane_shares(np.array(sizes, dtype=np.uint64), lanes)
    assert shares == expected
    assert shares[0][0] == 0 and shares[-1][1] == len(sizes)
    assert all(lo < hi for lo, hi in shares) and all(a[1] == b[0] for a, b in zip(shares, shares[1:]))


def test_a_lane_reports_a_read_it_cannot_post():
    """A part whose READ cannot even be created ends at once with an error (the rank's NIXL thread
    then fails the whole READ); the lane stays usable and closes cleanly."""
    import threading
    import time

    import torch

    from pdserve.kv_transfer.lanes import CopyLane
    from pdserve.transport.nixl_agent import NixlAgent

    buf = torch.zeros(1 << 20, dtype=torch.uint8)
    lane = CopyLane(NixlAgent("test-lane"), buf.data_ptr(), buf.numel(), "cpu")
    try:
        descs = np.array([[buf.data_ptr(), 4096, 0]], dtype=np.uint64)
        for _ in range(2):
            wake = threading.Event()
            part = lane.read("no-such-peer", descs, descs, time.monotonic() + 5, wake)
            assert part.done.wait(5) and wake.is_set()
            assert part.error and part.peer_gone
    finally:
        lane.close()
