"""One consumer request's remote KV load: its state (one enum, legal transitions in one place) and
what the consumer knows about the producer's lease for it. Engine process of a decode instance."""

from __future__ import annotations

import dataclasses
import enum

from pdserve.engine.request import Request
from pdserve.kv_transfer.messages import ReadDone, ReadFailure


class LoadState(enum.Enum):
    WAITING_PEER = "waiting_peer"  # handshake or first heartbeat acknowledgement outstanding
    READY = "ready"  # next step sends the READ
    READING = "reading"  # waiting for every rank's report
    ABORTING = "aborting"  # the client left while reading: end once every rank has reported


_TRANSITIONS = {
    LoadState.WAITING_PEER: {LoadState.READY},
    LoadState.READY: {LoadState.READING},
    LoadState.READING: {LoadState.ABORTING},
}
WAITING = (LoadState.WAITING_PEER, LoadState.READY)


@dataclasses.dataclass
class Load:
    request: Request
    state: LoadState = LoadState.WAITING_PEER
    deadline: float | None = None  # monotonic; no READ may be posted after it
    lease_s: float | None = None  # the producer's, from its acknowledgement
    quarantine_s: float = 0.0  # the producer's; our READ timeout stays below half of it
    last_heartbeat: float = 0.0
    reports_due: float = 0.0  # READING: the ranks must have reported by then
    results: dict[int, ReadDone | ReadFailure] = dataclasses.field(default_factory=dict)

    @property
    def params(self):
        return self.request.kv_transfer

    def move_to(self, state: LoadState) -> None:
        assert state in _TRANSITIONS.get(self.state, ()), f"{self.request.request_id}: {self.state} -> {state}"
        self.state = state
