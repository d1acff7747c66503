"""Extra copy lanes of a consumer rank: more NIXL agents, each with its own thread, on the same cache.

TP rank process. On host memory UCX performs a READ with process_vm_readv inside the posting call, so
one NIXL thread copies at one core's speed. A lane is a second agent registered on the same cache
memory, with a thread of its own; the rank's NIXL thread hands it part of a large READ and both parts
copy at once (measured here: two halves in parallel moved 16 MiB at 1.3-1.8x one thread). Lanes load
the same producer agents as the rank's main agent and never send notifications: the main thread
tells the producer once every part has landed. Jobs run in order, so a read queued after `add_peer`
finds the peer loaded.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time

import numpy as np

from pdserve.transport.nixl_agent import NixlAgent

logger = logging.getLogger(__name__)

POLL_S = 0.0002
LANE_MIN_BYTES = 1 << 20  # smaller READs are not worth a handoff to another thread


def lane_shares(sizes: np.ndarray, lanes: int, min_bytes: int = LANE_MIN_BYTES) -> list[tuple[int, int]]:
    """Split descriptors (their byte sizes, in order) into at most `lanes` consecutive row ranges of
    about equal bytes; one range when the READ is too small to be worth splitting."""
    total = int(sizes.sum())
    lanes = min(lanes, len(sizes))
    if lanes < 2 or total < min_bytes:
        return [(0, len(sizes))]
    cuts = np.searchsorted(np.cumsum(sizes), [total * i / lanes for i in range(1, lanes)])
    bounds = [0, *sorted({int(c) + 1 for c in cuts if int(c) + 1 < len(sizes)}), len(sizes)]
    return list(zip(bounds[:-1], bounds[1:]))


@dataclasses.dataclass
class LanePart:
    """One lane's share of a READ; `done` is set once its handle is released."""

    deadline: float
    wake: threading.Event
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: str | None = None
    peer_gone: bool = False

    def finish(self, error: str | None = None, peer_gone: bool = False) -> None:
        self.error, self.peer_gone = error, peer_gone
        self.done.set()
        self.wake.set()


class CopyLane:
    def __init__(self, name: str, backend: str, address: int, size_bytes: int, device: str):
        self.agent = NixlAgent(name, backend)
        self.agent.register(address, size_bytes, device)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"pdserve-lane-{name}", daemon=True)
        self._thread.start()

    def add_peer(self, metadata: bytes) -> None:
        self._jobs.put(("add", metadata))

    def remove_peer(self, name: str) -> None:
        self._jobs.put(("remove", name))

    def read(self, peer: str, local: np.ndarray, remote: np.ndarray, deadline: float,
             wake: threading.Event) -> LanePart:
        """Queue a READ of `remote` into `local`; `wake` is set when it ends (the rank's NIXL thread
        sleeps on it)."""
        part = LanePart(deadline, wake)
        self._jobs.put(("read", peer, local, remote, part))
        return part

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)
        self.agent.close()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if job[0] == "add":
                    self.agent.add_peer(job[1])
                elif job[0] == "remove":
                    self.agent.remove_peer(job[1])
                else:
                    self._read(*job[1:])
            except Exception:  # noqa: BLE001 - the lane must outlive one bad job
                logger.exception("copy lane %s: %s failed", self.agent.name, job[0])
                if job[0] == "read" and not job[-1].done.is_set():
                    job[-1].finish("the copy lane failed")

    def _read(self, peer: str, local: np.ndarray, remote: np.ndarray, part: LanePart) -> None:
        try:
            handle = self.agent.read(peer, local, remote, b"")
        except Exception as e:  # noqa: BLE001 - reported to the rank's NIXL thread
            return part.finish(str(e), peer_gone=True)
        state = self.agent.state(handle)
        while state == "PROC" and time.monotonic() < part.deadline:
            time.sleep(POLL_S)
            state = self.agent.state(handle)
        self.agent.release(handle)
        if state == "ERR":
            part.finish("the producer went away or the READ failed", peer_gone=True)
        else:
            part.finish("the READ timed out" if state == "PROC" else None)
