"""Extra copy lanes of a consumer rank: more transport agents on the same cache, each with a thread.

TP rank process. On host memory UCX performs a READ inside the posting call, so one thread copies at
one core's speed; a lane is a second agent registered on the same cache memory, with a thread of
its own, and the rank's transport thread hands it part of a large READ so both parts copy at once.
Lanes load the same producer agents as the rank's main agent and never send notifications: the
main thread tells the producer once every part has landed. Jobs run in order, so a READ queued after
`AddPeer` finds the peer loaded. A part that outlives its deadline is in doubt, exactly like a READ
of the main thread that times out: it may still land.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Callable

import numpy as np

from pdserve.transport.base import Agent, XferState

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
    wake: threading.Event  # the rank's transport thread sleeps on it
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: str | None = None
    peer_gone: bool = False
    in_doubt: bool = False  # abandoned while in flight: it may still land

    def finish(self, error: str | None = None, peer_gone: bool = False, in_doubt: bool = False) -> None:
        self.error, self.peer_gone, self.in_doubt = error, peer_gone, in_doubt
        self.done.set()
        self.wake.set()


@dataclasses.dataclass(frozen=True)
class AddPeer:
    metadata: bytes


@dataclasses.dataclass(frozen=True)
class RemovePeer:
    name: str


@dataclasses.dataclass(frozen=True)
class LaneRead:
    peer: str
    local: np.ndarray
    remote: np.ndarray
    part: LanePart


LaneJob = AddPeer | RemovePeer | LaneRead


class CopyLane:
    def __init__(self, agent: Agent, address: int, size_bytes: int, device: str, threaded: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        """`threaded=False`: the owner calls `run_once` itself (tests)."""
        self.agent = agent
        self.agent.register(address, size_bytes, device)
        self.clock = clock
        self._jobs: queue.SimpleQueue[LaneJob | None] = queue.SimpleQueue()
        self._inflight: list[tuple[object, LanePart]] = []
        self._closed = False
        self._thread = None
        if threaded:
            self._thread = threading.Thread(target=self._run, name=f"pdserve-lane-{agent.name}", daemon=True)
            self._thread.start()

    def add_peer(self, metadata: bytes) -> None:
        self._jobs.put(AddPeer(metadata))

    def remove_peer(self, name: str) -> None:
        self._jobs.put(RemovePeer(name))

    def read(self, peer: str, local: np.ndarray, remote: np.ndarray, deadline: float,
             wake: threading.Event) -> LanePart:
        """Queue a READ of `remote` into `local`; `wake` is set when it ends."""
        part = LanePart(deadline, wake)
        self._jobs.put(LaneRead(peer, local, remote, part))
        return part

    def close(self) -> None:
        self._jobs.put(None)
        if self._thread is not None:
            self._thread.join(timeout=5)
        else:
            self.run_once()
        self.agent.close()

    def run_once(self) -> None:
        """Run the queued jobs, then progress the parts in flight (the lane's thread, or a test)."""
        while not self._closed:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            self._do(job)
        self._progress()

    def _run(self) -> None:
        while not self._closed:
            try:
                job = self._jobs.get(timeout=POLL_S if self._inflight else None)
            except queue.Empty:
                job = ...
            if job is not ...:
                self._do(job)
            self.run_once()

    def _do(self, job: LaneJob | None) -> None:
        try:
            if job is None:
                self._closed = True
            elif isinstance(job, AddPeer):
                self.agent.add_peer(job.metadata)
            elif isinstance(job, RemovePeer):
                self.agent.remove_peer(job.name)
            else:
                self._post(job)
        except Exception:  # noqa: BLE001 - the lane must outlive one bad job
            logger.exception("copy lane %s: %s failed", self.agent.name, type(job).__name__)
            if isinstance(job, LaneRead) and not job.part.done.is_set():
                job.part.finish("the copy lane failed", peer_gone=True)

    def _post(self, job: LaneRead) -> None:
        try:
            handle = self.agent.read(job.peer, job.local, job.remote, b"")
        except Exception as e:  # noqa: BLE001 - reported to the rank's transport thread
            return job.part.finish(str(e), peer_gone=True)
        self._inflight.append((handle, job.part))

    def _progress(self) -> None:
        still = []
        for handle, part in self._inflight:
            state = self.agent.state(handle)
            if state == XferState.PROC and self.clock() < part.deadline:
                still.append((handle, part))
                continue
            self.agent.release(handle)
            if state == XferState.ERR:
                part.finish("the producer went away or the READ failed", peer_gone=True)
            elif state == XferState.PROC:
                part.finish("the READ timed out", peer_gone=True, in_doubt=True)
            else:
                part.finish()
        self._inflight = still
